"""A real `kvstore serve` whose data directory sits on a real, small filesystem (a
size-limited tmpfs the test mounts): filling up refuses puts with RESOURCE_EXHAUSTED
and keeps serving and keeping what was stored; a read-only remount refuses puts
cleanly and keeps serving reads. Skipped, with the reason, where mounting is not
allowed (it needs root or CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import grpc
import pytest

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from tests.chunks import chain
from tests.procs import KVSTORE, Served, store_config
from tests.service.conftest import keys_of, payloads_of

FS_BYTES = 48 << 20
NO_RETRY = ClientOptions(timeout_s=20.0, retries=0)


def _mount(point: Path, opts: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True
    )


@pytest.fixture
def small_fs(tmp_path):
    point = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
    point.mkdir()
    done = _mount(point, f"size={FS_BYTES}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    yield point
    subprocess.run(["umount", "-l", str(point)], capture_output=True)


def serve_on(fs: Path, tmp_path: Path) -> Served:
    cfg = store_config(tmp_path / "kvstore.yaml", fs / "lmdb", dram="1MiB")
    argv = [KVSTORE, "serve", "--config", str(cfg), "--nvme.map-size", "32MiB"]
    return Served(argv)


def stop(served: Served) -> None:
    """SIGTERM, so the store removes its shared memory; kill only one that hangs."""
    if served.proc.poll() is None:
        try:
            served.stop()
        except subprocess.TimeoutExpired:
            served.kill()


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill the filesystem with a plain file, leaving about ``leave`` bytes free."""
    filler = fs / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize > leave + (1 << 20):
            f.write(b"\xff" * (1 << 20))
            f.flush()
    return filler


def test_a_filling_disk_refuses_puts_and_keeps_everything_stored_before(small_fs, tmp_path):
    served = serve_on(small_fs, tmp_path)
    try:
        with KVStoreClient(served.address, NO_RETRY) as client:
            before = [chain(6, seed=s) for s in range(4)]
            for records in before:
                assert client.put(records).stored == 6
            filler = fill(small_fs)
            refused = 0
            for s in range(10, 40):  # new chains: LMDB needs new pages it cannot get
                try:
                    result = client.put(chain(6, seed=s))
                except ClientError as err:
                    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                    assert "full" in err.details
                    refused += 1
                else:
                    refused += result.stored < 6
            assert refused > 0
            for records in before:  # reads keep working; nothing stored earlier was lost
                assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
            filler.unlink()
            late = chain(6, seed=99)
            assert client.put(late).stored == 6  # room again: puts work again
        code, err = served.stop()
        assert code == 0, err
        served = serve_on(small_fs, tmp_path)  # and all of it survives a restart
        with KVStoreClient(served.address, NO_RETRY) as client:
            for records in before + [late]:
                assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
    finally:
        stop(served)


def test_a_read_only_data_directory_refuses_puts_and_serves_reads(small_fs, tmp_path):
    """The filesystem turns read-only between runs (as a kernel remounts one after
    errors); a live remount cannot be staged here, since Linux refuses to remount a
    filesystem read-only while the store holds files open for writing."""
    served = serve_on(small_fs, tmp_path)
    remounted = False
    try:
        with KVStoreClient(served.address, NO_RETRY) as client:
            before = [chain(6, seed=s) for s in range(3)]
            for records in before:
                assert client.put(records).stored == 6
        code, err = served.stop()
        assert code == 0, err
        done = subprocess.run(
            ["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")
        remounted = True
        served = serve_on(small_fs, tmp_path)
        with KVStoreClient(served.address, NO_RETRY) as client:
            for records in before:  # every chunk comes back from the read-only LMDB
                assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
            with pytest.raises(ClientError) as refused:
                client.put(chain(6, seed=50))
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "not writable" in refused.value.details
            assert client.lookup(keys_of(before[0])).matched == 6  # still serving
        assert served.proc.poll() is None
    finally:
        stop(served)
        if remounted:
            subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], capture_output=True)
