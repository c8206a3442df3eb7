"""Bytes a reader holds under a lease stay that chunk's until the lease ends, whatever
happens to its key meanwhile. Real shared-memory DRAM tier, no server."""

from __future__ import annotations

from kvstore.core.payload import parse_payload
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.chunks import CHUNK_COST, chain


def test_a_leased_chunk_deleted_stored_again_and_evicted_keeps_the_readers_bytes():
    """The reader's view must not be handed to another chunk: not when its key is
    deleted, stored again (new room), and that new copy is evicted under pressure."""
    store = TieredStore([DramTier(4 * CHUNK_COST)], write_policy="none")
    try:
        (first,) = chain(1, seed=50)
        others = [c for i in range(7) for c in chain(1, seed=60 + i)]
        assert store.put([first]).stored == 1
        lease, (view,) = store.get_shm([first.key], 60.0, views=True)
        assert bytes(view) == first.payload
        store.delete([first.key])
        assert store.put([first]).stored == 1  # stored again, in other room
        for rec in others:  # the new copy has no lease: pressure evicts it
            assert store.put([rec]).stored == 1
        assert store.lookup([first.key]).matched == 0
        assert bytes(view) == first.payload  # still the reader's chunk, not another
        parse_payload(view)
        dram = store.tiers[0]
        held_back = dram.free_bytes
        store.release(lease)
        assert dram.free_bytes == held_back + CHUNK_COST  # exactly the reader's room freed
        assert store.index.used[0] == dram.capacity_bytes - dram.free_bytes
    finally:
        store.close()
