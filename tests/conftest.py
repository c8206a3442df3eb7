"""Shared test set-up: skip ``gpu`` tests where CUDA is absent; ``open_store``; the
session fails if it leaves a store's shared-memory region behind, and removes the
semaphores of vLLM servers its tests killed."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier
from tests.chunks import CHUNK_COST
from tests.shm_regions import SHM_DIR, left_behind, orphan_semaphores

SLOT = CHUNK_COST  # room for one tests.chunks payload (32 KiB + header) in a memory tier
MiB = 1 << 20


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_shm_region_left_behind():
    """Every region a store made during the session is gone at its end, or still held by
    a live store of some other run: a killed store's is reclaimed by the next one."""
    start = time.time()
    yield
    leaked = left_behind(start)
    # a test that SIGKILLs a vLLM server's process group (a crash, on purpose) kills its
    # multiprocessing resource tracker too, which would have unlinked its semaphores
    for name in orphan_semaphores(start):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"the test session left shared-memory regions in /dev/shm: {leaked}"


@pytest.fixture
def open_store(tmp_path):
    """``open_store(dram_slots, nvme_bytes, policy, path=..., nvme={...}, **store_kw)``.

    ``dram_slots`` sizes the dram tier to hold that many ``tests.chunks`` payloads.

    A fresh store over real shared memory and an LMDB in ``tmp_path`` (or ``path``),
    closed at teardown. Reopening the same path rebuilds the index from LMDB.
    """
    opened: list[TieredStore] = []

    def _open(dram_slots=64, nvme_bytes=64 * MiB, policy="write_through", path=None, **kw):
        tiers = []
        if dram_slots:
            tiers.append(DramTier(dram_slots * SLOT))
        if nvme_bytes:
            lmdb_path = str(path or tmp_path / "lmdb")
            tiers.append(NvmeTier(lmdb_path, nvme_bytes, **kw.pop("nvme", {})))
        store = TieredStore(tiers, write_policy=policy, **kw)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()
