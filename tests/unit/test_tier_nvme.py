"""The nvme tier: a real LMDB environment in a temp dir, its writer thread, its framing."""

from __future__ import annotations

import threading
import time
import weakref

import lmdb
import numpy as np
import pytest
import zstandard

from kvstore.core.types import ChunkRecord, InvalidArgument, KVStoreError, TierFullError
from kvstore.server.tiers import nvme
from kvstore.server.tiers.base import StoredChunk, Tier
from kvstore.server.tiers.nvme import NvmeTier
from kvstore.server.tiers.nvme_format import HEADER

NS = bytes(range(32))
MiB = 1 << 20
MAP = 64 * MiB


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fp8_like(i: int, size: int) -> bytes:
    # Small-range bytes compress about as well as fp8 KV does (ratio ~1.2-2), unlike noise.
    rng = np.random.default_rng(i)
    return rng.normal(128, 20, size).clip(0, 255).astype(np.uint8).tobytes()


def record(i: int, size: int = 50_000) -> ChunkRecord:
    return ChunkRecord(key(i), key(i - 1) if i else None, NS, fp8_like(i, size))


def flip_byte(path: str, k: bytes, offset: int) -> None:
    """Damage one byte of a stored value, behind the tier's back (the tier must be closed)."""
    env = lmdb.open(path, subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(k))
        value[offset] ^= 0xFF
        txn.put(k, bytes(value))
    env.close()


@pytest.fixture(params=["zstd", "none"])
def compression(request) -> str:
    return request.param


def test_round_trip_and_read_into(tmp_path, compression):
    tier = NvmeTier(str(tmp_path / "db"), MAP, compression=compression)
    assert isinstance(tier, Tier) and tier.persistent
    assert tier.capacity_bytes == MAP and tier.cost(1000) == 1000
    recs = [record(i) for i in range(5)] + [ChunkRecord(key(9), None, NS, b"")]
    tier.write(recs)
    assert tier.read([r.key for r in recs] + [key(42)]) == [r.payload for r in recs] + [None]
    dest = np.zeros(60_000, dtype=np.uint8)
    assert tier.read_into(key(3), dest) == 50_000
    assert dest[:50_000].tobytes() == recs[3].payload
    assert tier.read_into(key(42), dest) is None
    with pytest.raises(InvalidArgument, match="dest holds 100 B"):
        tier.read_into(key(3), bytearray(100))
    tier.close()


def test_the_writer_keeps_no_payload_once_its_write_returned(tmp_path, compression):
    """A Put's part buffer goes back to its pool for the next chunk only if nothing still
    refers to it: the writer thread must not hold the last batch until the next arrives."""
    tier = NvmeTier(str(tmp_path / "db"), MAP, compression=compression)
    payload = np.frombuffer(fp8_like(1, 300_000), np.uint8).copy()
    gone = weakref.ref(payload)
    tier.write([ChunkRecord(key(0), None, NS, memoryview(payload))])
    del payload
    assert gone() is None
    assert tier.read([key(0)]) == [fp8_like(1, 300_000)]
    tier.close()


def test_restart_finds_every_chunk_with_its_parent_namespace_and_size(tmp_path, compression):
    path = str(tmp_path / "db")
    recs = [record(i, 10_000 * (i + 1)) for i in range(6)]
    tier = NvmeTier(path, MAP, compression=compression)
    tier.write(recs[:3])
    tier.write(recs[3:])
    tier.delete([key(4)])
    tier.close()

    tier = NvmeTier(path, MAP, compression=compression)
    kept = [r for r in recs if r.key != key(4)]
    assert sorted(tier.scan(), key=lambda c: c.key) == sorted(
        (StoredChunk(r.key, r.parent, r.ns, len(r.payload)) for r in kept), key=lambda c: c.key
    )
    assert tier.read([r.key for r in recs]) == [
        None if r.key == key(4) else r.payload for r in recs
    ]
    tier.close()


def test_values_written_with_one_compression_read_back_with_the_other(tmp_path):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, MAP, compression="zstd")
    tier.write([record(1)])
    tier.close()
    tier = NvmeTier(path, MAP, compression="none")
    assert tier.read([key(1)]) == [record(1).payload]
    tier.close()


@pytest.mark.parametrize(
    "size", [(1 << 20) - 1, 1 << 20, (1 << 20) + 1, (5 << 20) // 2], ids=lambda n: f"{n}B"
)
def test_values_over_a_compression_piece_are_one_zstd_frame(tmp_path, size):
    """Payloads are compressed a MiB at a time (no long GIL hold); the value must still be
    one zstd frame of the whole payload, and incompressible noise must fit its buffer."""
    tier = NvmeTier(str(tmp_path / "db"), MAP, compression="zstd")
    noise = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    recs = [ChunkRecord(key(1), None, NS, fp8_like(1, size)), ChunkRecord(key(2), None, NS, noise)]
    tier.write(recs)
    tier.close()
    env = lmdb.open(str(tmp_path / "db"), subdir=True, readonly=True)
    with env.begin() as txn:
        for r in recs:
            body = txn.get(r.key)[HEADER.size :]
            assert zstandard.ZstdDecompressor().decompress(body) == r.payload
    env.close()
    tier = NvmeTier(str(tmp_path / "db"), MAP, compression="zstd")
    assert tier.read([r.key for r in recs]) == [r.payload for r in recs]
    dest = np.zeros(size, dtype=np.uint8)
    assert tier.read_into(key(2), dest) == size and dest.tobytes() == noise
    tier.close()


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(HEADER.size + 17, id="body"),
        pytest.param(7 + 3, id="header-ns"),
        pytest.param(HEADER.size - 1, id="header-checksum"),
    ],
)
def test_a_flipped_byte_reads_as_a_miss_once_and_the_entry_is_dropped(tmp_path, compression, where):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, MAP, compression=compression)
    tier.write([record(1), record(2)])
    tier.close()
    flip_byte(path, key(1), where)

    tier = NvmeTier(path, MAP, compression=compression)
    dest = bytearray(50_000)
    assert tier.read([key(1), key(2)]) == [None, record(2).payload]
    assert tier.corrupt_count == 1
    assert tier.read([key(1)]) == [None]
    assert tier.read_into(key(1), dest) is None
    assert tier.corrupt_count == 1
    assert [c.key for c in tier.scan()] == [key(2)]
    tier.close()


def test_a_damaged_magic_is_dropped_by_scan_and_read_into(tmp_path):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, MAP)
    tier.write([record(1), record(2), record(3)])
    tier.close()
    flip_byte(path, key(1), 0)
    flip_byte(path, key(2), 0)

    tier = NvmeTier(path, MAP)
    assert tier.read_into(key(2), bytearray(50_000)) is None
    assert [c.key for c in tier.scan()] == [key(3)]
    assert tier.corrupt_count == 2
    tier.close()
    env = lmdb.open(path, subdir=True)
    with env.begin() as txn:
        assert [k for k, _ in txn.cursor()] == [key(3)]
    env.close()


def test_a_full_map_is_a_clear_error_and_everything_before_it_survives(tmp_path):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, 2 << 20, compression="none")
    written = []
    with pytest.raises(TierFullError, match=r"map_size=2097152 B reached; raise nvme map_size"):
        for i in range(100):
            rec = record(i, 64 << 10)
            tier.write([rec])
            written.append(rec)
    assert 10 < len(written) < 32
    assert tier.read([r.key for r in written]) == [r.payload for r in written]
    tier.write([ChunkRecord(key(1000), None, NS, b"small still fits")])
    tier.close()

    tier = NvmeTier(path, 2 << 20, compression="none")
    assert tier.read([r.key for r in written]) == [r.payload for r in written]
    assert len(list(tier.scan())) == len(written) + 1
    tier.close()


def hold_writer(tier: NvmeTier, monkeypatch) -> threading.Event:
    """Stop the writer thread in its next commit until the returned event is set, so that
    writes made meanwhile queue up and are committed together (LMDB group commit)."""
    release, held = threading.Event(), threading.Event()
    commit = tier._commit

    def held_commit(group):
        if not held.is_set():
            held.set()
            release.wait(timeout=30)
        commit(group)

    monkeypatch.setattr(tier, "_commit", held_commit)
    blocker = threading.Thread(target=tier.write, args=([record(50)],), daemon=True)
    blocker.start()
    assert held.wait(timeout=30)
    return release


def write_in_threads(tier: NvmeTier, batches: dict[str, list]) -> tuple[dict, list]:
    """Start one ``tier.write`` per batch, each in its own thread, and wait until all of them
    are queued behind the held writer; returns their outcomes (filled in as they finish)."""
    results: dict[str, BaseException | None] = {}

    def write(name: str, batch: list) -> None:
        try:
            tier.write(batch)
            results[name] = None
        except BaseException as exc:
            results[name] = exc

    threads = []
    for name, batch in batches.items():
        threads.append(threading.Thread(target=write, args=(name, batch), daemon=True))
        threads[-1].start()
        while tier._queue.qsize() < len(threads):
            time.sleep(0.001)  # queued in order, so each may share the next transaction
    return results, threads


def test_an_overflowing_batch_stores_nothing_and_fails_alone(tmp_path, compression, monkeypatch):
    tier = NvmeTier(str(tmp_path / "db"), 2 << 20, compression=compression)
    tier.write([record(i, 64 << 10) for i in range(5)])
    release = hold_writer(tier, monkeypatch)
    huge = [record(200 + i, 64 << 10) for i in range(40)]
    results, threads = write_in_threads(
        tier, {"before": [record(100)], "huge": huge, "after": [record(300)]}
    )
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert results["before"] is None and results["after"] is None
    assert isinstance(results["huge"], TierFullError)
    assert tier.read([key(200 + i) for i in range(40)]) == [None] * 40
    stored = [record(i, 64 << 10) for i in range(5)] + [record(100), record(300)]
    assert tier.read([r.key for r in stored]) == [r.payload for r in stored]
    tier.close()


def test_close_commits_what_is_queued(tmp_path, monkeypatch):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, MAP, sync=True)
    release = hold_writer(tier, monkeypatch)
    results, threads = write_in_threads(tier, {str(i): [record(i)] for i in range(20)})
    release.set()
    tier.close()
    tier.close()
    for t in threads:
        t.join(timeout=30)
    assert results == {str(i): None for i in range(20)}
    with pytest.raises(KVStoreError, match="closed"):
        tier.write([record(99)])
    tier = NvmeTier(path, MAP)
    assert len(list(tier.scan())) == 21  # and the write that held the writer
    tier.close()


def test_bad_records_are_refused_before_they_reach_the_writer(tmp_path):
    tier = NvmeTier(str(tmp_path / "db"), MAP)
    with pytest.raises(InvalidArgument, match="namespace must be 32 bytes"):
        tier.write([ChunkRecord(key(1), None, b"short", b"x")])
    with pytest.raises(InvalidArgument, match="parent must be 16 bytes"):
        tier.write([ChunkRecord(key(1), b"p", NS, b"x")])
    with pytest.raises(InvalidArgument, match="compression must be one of"):
        NvmeTier(str(tmp_path / "other"), MAP, compression="lz4")
    with pytest.raises(InvalidArgument, match="zstd_level 99 is invalid"):
        NvmeTier(str(tmp_path / "other"), MAP, zstd_level=99)
    fits = r"does not fit.*lower nvme map_size \(0 fits it to the disk\) or free disk space"
    with pytest.raises(InvalidArgument, match=fits):
        NvmeTier(str(tmp_path / "other"), 1 << 60)
    tier.close()


def test_many_threads_writing_and_reading_at_once(tmp_path):
    tier = NvmeTier(str(tmp_path / "db"), MAP)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for b in range(5):
                recs = [record(1000 * t + 10 * b + i, 20_000) for i in range(3)]
                tier.write(recs)
                assert tier.read([r.key for r in recs]) == [r.payload for r in recs]
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert errors == []
    assert len(list(tier.scan())) == 4 * 5 * 3
    tier.close()


def test_a_data_directory_held_by_a_live_store_is_refused_and_a_killed_one_is_not(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    path = str(tmp_path / "lmdb")
    first = NvmeTier(path, 16 << 20)
    with pytest.raises(KVStoreError, match=rf"data directory {path} is in use .*pid {os.getpid()}"):
        NvmeTier(path, 16 << 20)
    first.close()
    second = NvmeTier(path, 16 << 20)  # released on close
    second.close()

    code = textwrap.dedent(
        f"""
        import time
        from kvstore.server.tiers.nvme import NvmeTier
        t = NvmeTier({path!r}, 16 << 20)
        print("open", flush=True)
        time.sleep(600)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(KVStoreError, match=f"pid {holder.pid}"):
            NvmeTier(path, 16 << 20)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        NvmeTier(path, 16 << 20).close()  # the kernel dropped the dead holder's lock
    finally:
        holder.kill()
        holder.stdout.close()


def _disk_with_free(monkeypatch, free: int) -> None:
    """The tier's view of its filesystem, shrunk or grown: a test cannot make a disk of a
    chosen size, so ``shutil.disk_usage`` as the tier calls it reports ``free`` bytes."""
    real = nvme.shutil.disk_usage

    def fake_disk_usage(path):
        total, used, _ = real(path)
        return type(real(path))(total, used, free)

    monkeypatch.setattr(nvme.shutil, "disk_usage", fake_disk_usage)


@pytest.mark.parametrize(
    ("free", "expected"),
    [
        (1 << 40, nvme.AUTO_MAP_SIZE),  # a big disk: the whole default
        (63_000_000_000, 56_700_000_000 // MiB * MiB),  # CI's disk: 64 GiB would not fit
        (1 << 30, int(0.9 * (1 << 30)) // MiB * MiB),
    ],
)
def test_map_size_0_fits_the_map_to_the_disk_and_the_tier_works(
    tmp_path, monkeypatch, free, expected
):
    _disk_with_free(monkeypatch, free)
    path = str(tmp_path / "db")
    tier = NvmeTier(path, 0)
    try:
        assert tier.capacity_bytes == expected <= free
        tier.write([record(1)])
        assert tier.read([key(1)]) == [record(1).payload]
    finally:
        tier.close()


def test_map_size_0_counts_what_the_tier_already_holds(tmp_path, monkeypatch):
    path = str(tmp_path / "db")
    tier = NvmeTier(path, MAP, compression="none")
    tier.write([record(i, 1 << 20) for i in range(8)])
    tier.close()
    held = nvme._disk_room(path)[0]
    assert held >= 8 << 20
    _disk_with_free(monkeypatch, 1 << 30)
    assert nvme.fit_map_size(path, 0) == (held + int(0.9 * (1 << 30))) // MiB * MiB


def test_map_size_0_on_a_nearly_full_disk_is_a_clear_error(tmp_path, monkeypatch):
    _disk_with_free(monkeypatch, 100 << 20)
    with pytest.raises(InvalidArgument, match="only 104857600 B free.*nvme.map_size"):
        NvmeTier(str(tmp_path / "db"), 0)
