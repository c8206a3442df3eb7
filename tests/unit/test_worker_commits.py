"""The store's side of the put process: room in both tiers, claims, trusted commits,
give-backs and reclaiming. A real DRAM region and a real LMDB. The put process's LMDB
writes are made here through the store's own tier object (LMDB opens one environment
once per process), which writes the bytes and tells the index nothing, as that
process's writes do; tests/service/test_put_process.py has the real second process.
"""

import threading

import numpy as np
import pytest

from kvstore.core.types import NotFound
from tests.chunks import chain, keys_of

MiB = 1 << 20
GEN = 7  # a put process generation


@pytest.fixture
def store_and_writer(open_store):
    store = open_store(nvme_bytes=64 * MiB)
    return store, store.tiers[-1]


def _chunks(records):
    return [(r.key, r.parent, r.ns, len(r.payload)) for r in records]


def _fill(store, refs, records) -> None:
    """What the put process does with its room: copy each payload in."""
    region = store.tiers[0]
    for ref, rec in zip(refs, records, strict=True):
        view = np.frombuffer(region._region.mmap, np.uint8)[ref.offset : ref.offset + ref.length]
        view[:] = np.frombuffer(rec.payload, np.uint8)


def _in_lmdb(store, keys) -> set[bytes]:
    return set(store.tiers[-1].holding(keys))


def test_a_commit_records_what_the_put_process_persisted_without_writing_it_again(store_and_writer):
    store, writer = store_and_writer
    records = chain(3, seed=1)
    ticket, refs, stored = store.reserve_shm(_chunks(records), 30.0, worker=GEN)
    assert ticket and all(refs) and stored == [False] * 3
    nvme = store.index.used[store.last]
    assert nvme >= sum(len(r.payload) for r in records)  # the last tier's room is held
    _fill(store, refs, records)
    writer.write(records)
    written_before = store.stats().tiers[1].bytes_in
    result = store.commit_shm(ticket, worker=GEN, persisted=keys_of(records))
    assert (result.stored, result.rejected) == (3, [])
    assert store.lookup(keys_of(records)).matched == 3
    stats = store.stats()
    assert [t.chunks for t in stats.tiers] == [3, 3]
    assert stats.tiers[1].bytes_in - written_before == sum(len(r.payload) for r in records)
    assert store.index.used[store.last] == nvme  # charged once: held room became the chunks
    assert store.tiers[-1].read(keys_of(records)) == [r.payload for r in records]
    assert store._claims == {}


def test_a_key_the_put_process_claimed_is_refused_to_other_puts_until_it_commits(
    store_and_writer,
):
    store, writer = store_and_writer
    records = chain(2, seed=2)
    ticket, refs, _ = store.reserve_shm(_chunks(records), 30.0, worker=GEN)
    other = store.put(records)  # another client puts the same chunks meanwhile
    assert other.stored == 0 and [why for _, why in other.rejected][0].startswith("the put")
    # nor does anybody else get room for them
    assert store.reserve_shm(_chunks(records), 30.0, worker=GEN)[1] == [None, None]
    _fill(store, refs, records)
    writer.write(records)
    assert store.commit_shm(ticket, worker=GEN, persisted=keys_of(records)).stored == 2
    assert store.put(records).duplicates == 2


def test_what_the_put_process_wrote_for_a_refused_chunk_is_deleted_from_lmdb(store_and_writer):
    store, writer = store_and_writer
    parent, child = chain(2, seed=3)
    assert store.put([parent]).stored == 1
    ticket, refs, _ = store.reserve_shm(_chunks([child]), 30.0, worker=GEN)
    _fill(store, refs, [child])
    writer.write([child])
    store.delete([parent.key])  # deleted before the commit: the child has no parent now
    assert _in_lmdb(store, [child.key]) == {child.key}
    result = store.commit_shm(ticket, worker=GEN, persisted=[child.key])
    assert result.stored == 0 and result.rejected[0][1] == "parent is not stored"
    assert _in_lmdb(store, [child.key]) == set()
    assert store.index.used == [0, 0] and store._claims == {}


def test_the_put_process_gets_no_room_under_a_parent_that_is_not_its_owner_s(store_and_writer):
    """It writes LMDB before the commit's checks; a store that dies in between rebuilds
    from LMDB, so room under an absent or another tenant's parent would graft the chunk."""
    store, _ = store_and_writer
    parent, child = chain(2, seed=12)
    assert store.reserve_shm(_chunks([child]), 30.0, worker=GEN)[0] is None  # no parent
    owner_y = parent.ns[:8]  # a tenant's tag heads its namespaces (kvstore.server.auth)
    owner_x = bytes(b ^ 0xFF for b in owner_y)
    assert store.put([parent], owner=owner_y).stored == 1
    ticket, refs, _ = store.reserve_shm(_chunks([child]), 30.0, owner=owner_x, worker=GEN)
    assert ticket is None and refs == [None]
    ticket, refs, _ = store.reserve_shm(_chunks([child]), 30.0, owner=owner_y, worker=GEN)
    assert ticket is not None and refs[0] is not None
    store.abort_shm(ticket, GEN)


def test_a_reserved_chunk_is_filed_under_its_chain_s_namespace(store_and_writer):
    store, _ = store_and_writer
    root, child, grandchild = chain(3, seed=13)
    other_ns = b"\x01" * 32  # what a client may send for a chunk that is not a chain's first
    chunks = [
        (c.key, c.parent, other_ns if c.parent else c.ns, len(c.payload))
        for c in (root, child, grandchild)
    ]
    ticket, _, _ = store.reserve_shm(chunks, 30.0, worker=GEN)
    assert store.reserved_namespaces(ticket) == {r.key: root.ns for r in (root, child, grandchild)}
    store.abort_shm(ticket, GEN)


def test_last_tier_room_for_a_chunk_never_evicts_its_own_parent(tmp_path):
    from kvstore.server.store import TieredStore
    from kvstore.server.tiers.dram import DramTier
    from kvstore.server.tiers.nvme import NvmeTier
    from tests.chunks import CHUNK_COST

    parent, child = chain(2, seed=50)
    size = len(parent.payload)
    nvme = NvmeTier(str(tmp_path / "lmdb"), 64 * MiB)
    nvme.capacity_bytes = 6 * size  # the index sees room for six chunks
    store = TieredStore([DramTier(4 * CHUNK_COST), nvme])
    try:
        store.put([parent])
        for seed in range(51, 55):  # newer chains: the parent is the oldest, and leaves DRAM
            store.put(chain(1, seed=seed))
        assert store.index.get(parent.key).tiers == 0b10  # in nvme only, and nvme is full
        ticket, refs, _ = store.reserve_shm(_chunks([child]), 30.0, worker=GEN)
        assert store.index.get(parent.key) is not None  # another chunk made the room
        _fill(store, refs, [child])
        store.tiers[-1].write([child])
        assert store.commit_shm(ticket, worker=GEN, persisted=[child.key]).stored == 1
        assert store.lookup(keys_of([parent, child])).matched == 2
    finally:
        store.close()


def test_a_put_of_a_key_the_put_process_is_storing_waits_and_finds_it_stored(
    store_and_writer,
):
    """Two requests saving one system prompt: the second put waits for the first's claim,
    instead of being refused with every chunk after the shared prefix."""
    store, writer = store_and_writer
    shared = chain(2, seed=14)
    ticket, refs, _ = store.reserve_shm(_chunks(shared), 30.0, worker=GEN)
    done: list = []
    other = threading.Thread(target=lambda: done.append(store.put(shared)))
    other.start()
    other.join(0.3)
    assert other.is_alive()  # waiting for the claim, not refused
    _fill(store, refs, shared)
    writer.write(shared)
    assert store.commit_shm(ticket, worker=GEN, persisted=keys_of(shared)).stored == 2
    other.join(10)
    assert (done[0].stored, done[0].duplicates, done[0].rejected) == (0, 2, [])


def test_a_commit_whose_chunks_the_put_process_could_not_persist_is_written_by_the_store(
    store_and_writer,
):
    store, _ = store_and_writer
    records = chain(2, seed=4)
    ticket, refs, _ = store.reserve_shm(_chunks(records), 30.0, worker=GEN)
    _fill(store, refs, records)
    # says it persisted them, but nothing is in LMDB: the store checks and writes them itself
    result = store.commit_shm(ticket, worker=GEN, persisted=keys_of(records))
    assert result.stored == 2
    assert store.tiers[-1].read(keys_of(records)) == [r.payload for r in records]


def test_reclaiming_a_dead_put_process_gives_back_room_claims_and_its_lmdb_writes(store_and_writer):
    store, writer = store_and_writer
    records = chain(2, seed=5)
    ticket, refs, _ = store.reserve_shm(_chunks(records), 30.0, worker=GEN)
    _fill(store, refs, records)
    writer.write(records)  # ... and then it died before committing
    assert store.reclaim_worker(GEN + 1) == 0  # another generation's: untouched
    assert store.index.used[0] > 0
    assert store.reclaim_worker(GEN) == 1
    assert store.index.used == [0, 0] and store._claims == {} and store._tickets == {}
    assert _in_lmdb(store, keys_of(records)) == set()
    with pytest.raises(NotFound):
        store.commit_shm(ticket, worker=GEN, persisted=keys_of(records))
    assert store.put(records).stored == 2  # the keys are free again


def test_the_put_process_s_room_does_not_lapse_with_time_but_a_client_s_does(open_store):
    clock = [0.0]
    store = open_store(clock=lambda: clock[0])
    mine, theirs = chain(1, seed=6), chain(1, seed=7)
    t_worker, _, _ = store.reserve_shm(_chunks(mine), 1.0, worker=GEN)
    t_client, _, _ = store.reserve_shm(_chunks(theirs), 1.0)
    clock[0] = 100.0
    with pytest.raises(NotFound):
        store.commit_shm(t_client)
    assert t_worker in store._tickets
    store.abort_shm(t_worker, GEN)
    assert store._tickets == {} and store.index.used == [0, 0]


def test_a_client_cannot_commit_the_put_process_s_ticket_nor_the_reverse(store_and_writer):
    store, _ = store_and_writer
    records = chain(1, seed=8)
    ticket, _, _ = store.reserve_shm(_chunks(records), 30.0, worker=GEN)
    with pytest.raises(NotFound):
        store.commit_shm(ticket)  # no trust without the put process's generation
    client_ticket, _, _ = store.reserve_shm(_chunks(chain(1, seed=9)), 30.0)
    with pytest.raises(NotFound):
        store.commit_shm(client_ticket, worker=GEN, persisted=[])
