"""The dram tier: a real shared-memory region, cut into slots."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DramTier
from kvstore.types import ChunkRecord, InvalidArgument, KVStoreError, TierFullError

SLOT = 4096
NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def record(i: int, size: int = SLOT) -> ChunkRecord:
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    return ChunkRecord(key(i), key(i - 1) if i else None, NS, payload)


@pytest.fixture
def tier():
    t = DramTier(capacity_bytes=4 * SLOT, slot_bytes=SLOT)
    yield t
    t.close()


def test_round_trip_is_byte_exact_and_costs_a_whole_slot(tier):
    assert isinstance(tier, Tier)
    assert tier.capacity_bytes == 4 * SLOT and not tier.persistent
    assert tier.cost(10) == SLOT
    small, full = record(1, 10), record(2)
    tier.write([small, full])
    got = tier.read([key(1), key(2)])
    assert [bytes(v) for v in got] == [small.payload, full.payload]
    assert all(v.readonly for v in got)
    assert list(tier.scan()) == []


def test_missing_key_reads_as_none(tier):
    tier.write([record(1)])
    assert tier.read([key(9), key(1)])[0] is None
    assert tier.read_into(key(9), bytearray(SLOT)) is None
    assert tier.slot_handle(key(9)) is None


def test_delete_frees_the_slot_for_the_next_write(tier):
    tier.write([record(i) for i in range(4)])
    assert tier.free_slots == 0
    tier.delete([key(2), key(77)])
    assert tier.read([key(2)]) == [None]
    tier.write([record(5)])
    assert bytes(tier.read([key(5)])[0]) == record(5).payload
    assert len(tier) == 4


def test_full_batch_is_refused_whole_and_nothing_stored_changes(tier):
    tier.write([record(i) for i in range(3)])
    with pytest.raises(TierFullError, match="dram tier full"):
        tier.write([record(10), record(11)])
    assert tier.read([key(10), key(11)]) == [None, None]
    assert tier.free_slots == 1
    for i in range(3):
        assert bytes(tier.read([key(i)])[0]) == record(i).payload
    tier.write([record(10)])


def test_oversize_payload_is_an_invalid_argument_and_nothing_is_stored(tier):
    with pytest.raises(InvalidArgument, match="exceeds slot_bytes=4096"):
        tier.write([record(1), record(2, SLOT + 1)])
    assert tier.read([key(1)]) == [None]
    assert tier.free_slots == 4


def test_overwrite_in_a_full_tier_rewrites_the_slot_in_place(tier):
    tier.write([record(i) for i in range(4)])
    offset = tier.slot_handle(key(1))[0]
    tier.write([ChunkRecord(key(1), None, NS, b"new"), ChunkRecord(key(1), None, NS, b"newer")])
    assert bytes(tier.read([key(1)])[0]) == b"newer"
    assert tier.slot_handle(key(1)) == (offset, 5)
    assert tier.free_slots == 0
    with pytest.raises(TierFullError):
        tier.write([record(1), record(9)])
    assert bytes(tier.read([key(1)])[0]) == b"newer"


def test_read_into_copies_into_numpy_and_bytearray(tier):
    rec = record(3, 1000)
    tier.write([rec])
    dest = np.zeros(SLOT, dtype=np.uint8)
    assert tier.read_into(key(3), dest) == 1000
    assert dest[:1000].tobytes() == rec.payload
    small = bytearray(999)
    with pytest.raises(InvalidArgument, match="dest holds 999 B"):
        tier.read_into(key(3), small)


def test_payload_may_be_any_contiguous_buffer(tier):
    arr = np.arange(SLOT // 4, dtype=np.float32)
    tier.write([ChunkRecord(key(1), None, NS, memoryview(arr))])
    assert bytes(tier.read([key(1)])[0]) == arr.tobytes()
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        tier.write([ChunkRecord(key(2), None, NS, memoryview(arr)[::2])])


def test_another_process_reads_a_slot_through_its_handle(tier):
    rec = record(7, 3000)
    tier.write([record(6), rec])
    offset, length = tier.slot_handle(key(7))
    code = textwrap.dedent(
        f"""
        import sys
        from kvstore.tiers.dram import attach_region
        region = attach_region({tier.region_name!r})
        sys.stdout.write(region[{offset}:{offset + length}].hex())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert bytes.fromhex(out.stdout) == rec.payload
    # The other process exiting must not have taken the region with it.
    assert os.path.exists(f"/dev/shm/{tier.region_name}")
    assert bytes(tier.read([key(7)])[0]) == rec.payload


def test_close_unlinks_the_region_and_later_use_is_a_clear_error():
    t = DramTier(capacity_bytes=2 * SLOT, slot_bytes=SLOT)
    t.write([record(1)])
    path = f"/dev/shm/{t.region_name}"
    assert os.path.getsize(path) == 2 * SLOT
    t.close()
    t.close()
    assert not os.path.exists(path)
    with pytest.raises(KVStoreError, match="closed"):
        t.read([key(1)])


def test_a_region_name_in_use_is_refused_with_a_way_out(tier):
    with pytest.raises(KVStoreError, match="already exists"):
        DramTier(capacity_bytes=SLOT, slot_bytes=SLOT, region_name=tier.region_name)
    tier.write([record(1)])
    assert bytes(tier.read([key(1)])[0]) == record(1).payload


def test_capacity_smaller_than_one_slot_is_refused():
    with pytest.raises(InvalidArgument, match="at least one slot"):
        DramTier(capacity_bytes=SLOT - 1, slot_bytes=SLOT)


def test_threads_writing_and_deleting_keep_every_chunk_intact():
    t = DramTier(capacity_bytes=16 * SLOT, slot_bytes=SLOT)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for round_ in range(50):
                recs = [record(100 * w + i) for i in range(3)]
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
    assert len(t) == 0 and t.free_slots == 16
    t.close()
