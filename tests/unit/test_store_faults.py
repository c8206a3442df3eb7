"""The store under I/O that stalls or fails: lookups go on, pins never leak, puts say
what they stored. Real shared memory and a real LMDB; a gate holds a tier's write or
read at a known point (no timing involved)."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from kvstore.core.payload import ChunkHeader, build_payload, expected_body_len
from kvstore.core.types import ChunkRecord, KVStoreError
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier
from tests.chunks import CHUNK_COST, chain, keys_of, payloads_of

MiB = 1 << 20


class GatedNvmeTier(NvmeTier):
    """A real LMDB tier whose writes (or reads) can be held at their start, or made to fail."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold_writes = threading.Event()
        self.writing = threading.Event()
        self.go = threading.Event()
        self.fail_reads = 0

    def write(self, records):
        if self.hold_writes.is_set():
            self.writing.set()
            assert self.go.wait(60), "the test never let the write go"
        return super().write(records)

    def read(self, keys):
        if self.fail_reads:
            self.fail_reads -= 1
            raise KVStoreError("nvme: injected read failure")
        return super().read(keys)


@pytest.fixture
def gated(tmp_path):
    stores: list[TieredStore] = []

    def _open(dram_chunks: int = 64, nvme_bytes: int = 256 * MiB, **kw) -> TieredStore:
        tiers = [DramTier(dram_chunks * CHUNK_COST), GatedNvmeTier(str(tmp_path), nvme_bytes)]
        store = TieredStore(tiers, **kw)
        stores.append(store)
        return store

    yield _open
    for s in stores:
        s.tiers[1].go.set()
        s.close()


def test_lookups_and_dram_reads_go_on_while_a_put_waits_on_lmdb(gated):
    store = gated()
    stored, pending = chain(4, seed=1), chain(4, seed=2)
    store.put(stored)
    nvme = store.tiers[1]
    nvme.hold_writes.set()
    putter = threading.Thread(target=store.put, args=(pending,))
    putter.start()
    assert nvme.writing.wait(30)  # the put holds the writer lock, inside the LMDB write
    done = threading.Event()
    seen = {}

    def reader() -> None:
        seen["lookup"] = store.lookup(keys_of(stored), lease_ttl_s=30)
        seen["get"] = store.get(keys_of(stored))
        seen["stats"] = store.stats()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    finished = done.wait(30)
    still_blocked = putter.is_alive()
    nvme.go.set()
    putter.join(30)
    assert finished and still_blocked  # the reads completed while the write was held
    assert seen["lookup"].matched == 4
    assert [bytes(p) for p in seen["get"]] == payloads_of(stored)
    assert store.get(keys_of(pending)) == payloads_of(pending)


def llama_fp8_chain(n: int, seed: int) -> list[ChunkRecord]:
    """``n`` chained chunks of Llama-3-8B's geometry at 256 tokens in fp8 (~16.4 MiB each)."""
    shape = (32, 8, 256, 128)
    body_len = expected_body_len("fp8", "bfloat16", shape)
    header = ChunkHeader("fp8", "bfloat16", *shape[:3], shape[3], body_len)
    rng = np.random.default_rng(seed)
    ns = hashlib.sha256(b"llama-3-8b-fp8").digest()
    out, parent = [], None
    for i in range(n):
        key = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest()
        body = rng.integers(0, 256, body_len, dtype=np.uint8)
        out.append(ChunkRecord(key, parent, ns, build_payload(header, body)))
        parent = key
    return out


def test_lookup_progress_under_a_stream_of_64_mib_puts(tmp_path, request):
    """Real-sized traffic: 64 MiB puts (four Llama-3-8B fp8 chunks) while lookups run.

    Bounded by counts, not timed: several lookups must complete while each put is in
    flight, which cannot happen if a lookup queues behind the writer's I/O.
    """
    tiers = [DramTier(128 * MiB), NvmeTier(str(tmp_path / "lmdb"), 1024 * MiB)]
    store = TieredStore(tiers, write_policy="write_through")
    request.addfinalizer(store.close)
    probe = chain(8, seed=7)
    store.put(probe)
    probe_keys = keys_of(probe) + [bytes([i % 256]) * 16 for i in range(504)]  # 512 keys
    puts = [llama_fp8_chain(4, seed=s) for s in range(4)]
    in_flight: list[int | None] = [None]
    during = [0] * len(puts)
    stop = threading.Event()

    def lookups() -> None:
        while not stop.is_set():
            assert store.lookup(probe_keys).matched == 8
            k = in_flight[0]
            if k is not None:
                during[k] += 1

    looker = threading.Thread(target=lookups, daemon=True)
    looker.start()
    try:
        for k, records in enumerate(puts):
            in_flight[0] = k
            assert store.put(records).stored == 4
            in_flight[0] = None
    finally:
        stop.set()
        looker.join(30)
    assert not looker.is_alive()
    assert min(during) >= 3, during
    assert store.stats().tiers[1].chunks == 8 + 16  # all written through
    assert store.get(keys_of(puts[-1])) == payloads_of(puts[-1])


def test_a_failed_lmdb_read_releases_its_pins(gated):
    store = gated(dram_chunks=2, write_policy="write_through")
    records = chain(6, seed=3)
    store.put(records)
    assert store.lookup(keys_of(records)).tiers[:2] == ["nvme", "nvme"]
    store.tiers[1].fail_reads = 1
    with pytest.raises(KVStoreError, match="injected"):
        store.get(keys_of(records))
    assert all(store.index.get(k).leases == 0 for k in keys_of(records))
    assert store.stats().active_leases == 0
    # nothing pinned: the chain can be deleted and its memory is all free again
    assert store.delete([records[0].key]) == 6
    assert store.tiers[0].free_bytes == store.tiers[0].capacity_bytes


def test_a_put_that_fills_the_tiers_midway_writes_through_and_reports_what_it_stored(
    tmp_path, request
):
    def open_it() -> TieredStore:
        tiers = [DramTier(8 * CHUNK_COST), NvmeTier(str(tmp_path / "lmdb"), 1 * MiB)]
        return TieredStore(tiers, write_policy="write_through")

    store = open_it()
    request.addfinalizer(store.close)
    small = chain(3, seed=4)
    shape = (2, 2, 2048, 64)  # 2 MiB: larger than either tier
    header = ChunkHeader("raw", "float16", *shape[:3], shape[3], 2 * MiB)
    huge = ChunkRecord(
        b"\x42" * 16, small[-1].key, small[0].ns, build_payload(header, bytes(2 * MiB))
    )
    after = chain(5, seed=4)[3:]  # its own chain would follow; rejected with its parent
    after[0] = ChunkRecord(after[0].key, huge.key, after[0].ns, after[0].payload)
    result = store.put(small + [huge, after[0]])
    assert (result.stored, result.duplicates) == (3, 0)
    assert [k for k, _ in result.rejected] == [huge.key, after[0].key]
    assert result.rejected[0][1].startswith("tiers full: no tier can admit")
    assert result.rejected[1][1] == "parent was rejected"
    assert store.stats().tiers[1].chunks == 3  # what was admitted was written through
    store.close()
    again = open_it()
    try:
        assert again.lookup(keys_of(small)).tiers == ["nvme"] * 3
        assert again.get(keys_of(small)) == payloads_of(small)
    finally:
        again.close()


def test_write_through_keeps_the_longest_prefix_that_fits_and_counts_the_rest(tmp_path, request):
    tiers = [DramTier(4 * CHUNK_COST), NvmeTier(str(tmp_path / "lmdb"), 1 * MiB)]
    store = TieredStore(tiers, write_policy="write_through", high_watermark=1.0, low_watermark=1.0)
    records = chain(40, seed=5)  # ~1.3 MiB: more than the LMDB map holds
    request.addfinalizer(store.close)
    result = store.put(records)
    assert 0 < result.stored < len(records)
    stats = store.stats()
    assert stats.tiers[1].chunks == result.stored  # acknowledged means persisted
    assert stats.rejected["tiers_full"] == 1
    not_persisted = [k for k, why in result.rejected if why.startswith("not persisted")]
    if not_persisted:  # LMDB's own overhead ran out before the index's count did
        assert stats.rejected["write_through_full"] == 1
    assert store.get(keys_of(records[: result.stored])) == payloads_of(records[: result.stored])
