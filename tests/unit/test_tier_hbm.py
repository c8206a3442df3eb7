"""The hbm tier on a real CUDA device (skipped where there is none)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.types import ChunkRecord, InvalidArgument, TierFullError

pytestmark = pytest.mark.gpu

SLOT = 1 << 20
NS = bytes(32)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def record(i: int, size: int = SLOT) -> ChunkRecord:
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    return ChunkRecord(key(i), None, NS, payload)


@pytest.fixture
def tier():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device")
    from kvstore.server.tiers.hbm import HbmTier

    t = HbmTier(capacity_bytes=4 * SLOT)
    yield t
    t.close()


def test_round_trip_through_device_memory(tier):
    import cupy

    recs = [record(1), record(2, 1000)]
    tier.write(recs)
    assert [bytes(v) for v in tier.read([key(1), key(2), key(3)])[:2]] == [r.payload for r in recs]
    assert tier.read([key(3)]) == [None]
    dest = np.zeros(SLOT, dtype=np.uint8)
    assert tier.read_into(key(2), dest) == 1000
    assert dest[:1000].tobytes() == recs[1].payload
    offset, length = tier.slot_handle(key(2))
    on_device = tier._slab[offset : offset + length]
    assert cupy.asnumpy(on_device).tobytes() == recs[1].payload


def test_full_and_oversize_batches_change_nothing(tier):
    small = SLOT - 16  # with its key, exactly a quarter of the tier
    tier.write([record(i, small) for i in range(3)])
    with pytest.raises(TierFullError):
        tier.write([record(10, small), record(11, small)])
    with pytest.raises(InvalidArgument, match="larger than the whole tier"):
        tier.write([record(12, 4 * SLOT)])
    assert tier.free_bytes == SLOT
    assert [bytes(v) for v in tier.read([key(i) for i in range(3)])] == [
        record(i, small).payload for i in range(3)
    ]
    tier.delete([key(0)])
    tier.write([record(10, small), record(11, small // 2)])
