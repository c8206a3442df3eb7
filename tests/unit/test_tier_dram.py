"""The dram tier: a real shared-memory region shared by chunks of any size."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from kvstore.core.types import KEY_BYTES, ChunkRecord, InvalidArgument, KVStoreError, TierFullError
from kvstore.server.tiers.base import Tier
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.extents import ALIGN
from kvstore.server.tiers.shm_region import reclaim_stale

UNIT = 4096 - KEY_BYTES  # a payload that, with its key, costs exactly 4 KiB
NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def record(i: int, size: int = UNIT) -> ChunkRecord:
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    return ChunkRecord(key(i), key(i - 1) if i else None, NS, payload)


@pytest.fixture
def tier():
    t = DramTier(capacity_bytes=4 * 4096)
    yield t
    t.close()


def test_round_trip_is_byte_exact_and_costs_key_plus_payload_rounded(tier):
    assert isinstance(tier, Tier)
    assert tier.capacity_bytes == 4 * 4096 and not tier.persistent
    assert tier.cost(10) == ALIGN
    assert tier.cost(UNIT) == 4096 and tier.cost(UNIT + 1) == 4096 + ALIGN
    small, full = record(1, 10), record(2)
    tier.write([small, full])
    got = tier.read([key(1), key(2)])
    assert [bytes(v) for v in got] == [small.payload, full.payload]
    assert all(v.readonly for v in got)
    assert list(tier.scan()) == []
    assert tier.free_bytes == 4 * 4096 - ALIGN - 4096


def test_missing_key_reads_as_none(tier):
    tier.write([record(1)])
    assert tier.read([key(9), key(1)])[0] is None
    assert tier.read_into(key(9), bytearray(UNIT)) is None
    assert tier.slot_handle(key(9)) is None


def test_chunks_of_very_different_sizes_share_the_region():
    t = DramTier(capacity_bytes=1 << 20)
    try:
        recs = [record(1, 100), record(2, 300_000), record(3, 7), record(4, 600_000)]
        t.write(recs)
        assert [bytes(v) for v in t.read([r.key for r in recs])] == [r.payload for r in recs]
        assert t.free_bytes == (1 << 20) - sum(t.cost(len(r.payload)) for r in recs)
    finally:
        t.close()


def test_the_key_sits_just_before_each_payload(tier):
    rec = record(5, 1234)
    tier.write([rec])
    offset, length = tier.slot_handle(key(5))
    with open(f"/dev/shm/{tier.region_name}", "rb") as f:
        region = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert region[offset - KEY_BYTES : offset] == key(5)
        assert region[offset : offset + length] == rec.payload
    finally:
        region.close()


def test_a_fragmented_region_splits_a_chunk_and_still_reads_it_back(tier):
    tier.write([record(i) for i in range(4)])
    tier.delete([key(0), key(2)])  # two free 4 KiB holes, not adjacent
    big = record(9, 2 * 4096 - KEY_BYTES)
    tier.write([big])
    assert tier.slot_handle(key(9)) is None  # split: never offered as one shared-memory span
    assert bytes(tier.read([key(9)])[0]) == big.payload
    dest = bytearray(len(big.payload))
    assert tier.read_into(key(9), dest) == len(big.payload) and bytes(dest) == big.payload
    tier.delete([key(9), key(1), key(3)])
    assert tier.free_bytes == 4 * 4096
    whole = record(10, 4 * 4096 - KEY_BYTES)  # freed extents merged back into one
    tier.write([whole])
    assert tier.slot_handle(key(10)) is not None


def test_delete_frees_room_for_the_next_write(tier):
    tier.write([record(i) for i in range(4)])
    assert tier.free_bytes == 0
    with pytest.raises(TierFullError, match="dram tier full"):
        tier.write([record(4)])
    tier.delete([key(0), key(99)])
    tier.write([record(4)])
    assert bytes(tier.read([key(4)])[0]) == record(4).payload


def test_a_batch_that_does_not_fit_changes_nothing(tier):
    tier.write([record(1)])
    with pytest.raises(TierFullError):
        tier.write([record(2), record(3), record(4), record(5)])
    assert tier.free_bytes == 3 * 4096 and len(tier) == 1
    with pytest.raises(InvalidArgument, match="larger than the whole tier"):
        tier.write([record(6, 5 * 4096)])
    assert tier.free_bytes == 3 * 4096


def test_a_stored_key_keeps_its_bytes(tier):
    tier.write([record(1)])
    offset = tier.slot_handle(key(1))[0]
    tier.write([ChunkRecord(key(1), None, NS, b"other")])
    assert tier.slot_handle(key(1)) == (offset, UNIT)
    assert bytes(tier.read([key(1)])[0]) == record(1).payload


def test_read_into_copies_into_numpy_and_bytearray(tier):
    rec = record(3, 1000)
    tier.write([rec])
    dest = np.zeros(UNIT, dtype=np.uint8)
    assert tier.read_into(key(3), dest) == 1000
    assert dest[:1000].tobytes() == rec.payload
    with pytest.raises(InvalidArgument, match="dest holds 999 B"):
        tier.read_into(key(3), bytearray(999))


def test_payload_may_be_any_contiguous_buffer(tier):
    arr = np.arange(UNIT // 4, dtype=np.float32)
    tier.write([ChunkRecord(key(1), None, NS, memoryview(arr))])
    assert bytes(tier.read([key(1)])[0]) == arr.tobytes()
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        tier.write([ChunkRecord(key(2), None, NS, memoryview(arr)[::2])])


def test_another_process_reads_a_chunk_through_its_handle(tier):
    rec = record(7, 3000)
    tier.write([record(6), rec])
    offset, length = tier.slot_handle(key(7))
    code = textwrap.dedent(
        f"""
        import mmap, sys
        with open("/dev/shm/{tier.region_name}", "rb") as f:
            region = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        sys.stdout.write(region[{offset}:{offset + length}].hex())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert bytes.fromhex(out.stdout) == rec.payload
    assert os.path.exists(f"/dev/shm/{tier.region_name}")
    assert bytes(tier.read([key(7)])[0]) == rec.payload


def test_close_unlinks_the_region_and_later_use_is_a_clear_error():
    t = DramTier(capacity_bytes=2 * 4096)
    t.write([record(1)])
    path = f"/dev/shm/{t.region_name}"
    assert os.path.getsize(path) == 2 * 4096
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    t.close()
    t.close()
    assert not os.path.exists(path)
    with pytest.raises(KVStoreError, match="closed"):
        t.read([key(1)])


def test_a_region_name_in_use_is_refused(tier):
    with pytest.raises(KVStoreError, match="already exists"):
        DramTier(capacity_bytes=4096, region_name=tier.region_name)
    tier.write([record(1)])
    assert bytes(tier.read([key(1)])[0]) == record(1).payload


def test_a_tiny_capacity_is_refused():
    with pytest.raises(InvalidArgument, match="at least 512 B"):
        DramTier(capacity_bytes=100)


def test_a_killed_owners_region_is_reclaimed_and_a_live_ones_is_not(tier):
    code = textwrap.dedent(
        """
        import sys, time
        from kvstore.server.tiers.dram import DramTier
        t = DramTier(capacity_bytes=1 << 20)
        print(t.region_name, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert os.path.exists(f"/dev/shm/{name}")
        assert name not in reclaim_stale()  # its owner is alive
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert os.path.exists(f"/dev/shm/{name}")  # a killed store leaves it behind ...
        assert name in reclaim_stale()  # ... and the next one to start removes it
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(f"/dev/shm/{tier.region_name}")  # ours is held: untouched
    finally:
        proc.kill()
        proc.stdout.close()


def test_threads_writing_and_deleting_keep_every_chunk_intact():
    t = DramTier(capacity_bytes=64 * 4096)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for round_ in range(50):
                recs = [record(100 * w + i, 500 + 900 * i) for i in range(3)]
                t.write(recs)
                for r in recs:
                    assert bytes(t.read([r.key])[0]) == r.payload
                if round_ % 2:
                    t.delete([r.key for r in recs])
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert errors == []
    assert len(t) == 0 and t.free_bytes == 64 * 4096
    t.close()
