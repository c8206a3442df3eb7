"""The store's side of the put process: room in both tiers, claims, trusted commits,
give-backs and reclaiming. A real DRAM region and a real LMDB. The put process's LMDB
writes are made here through the store's own tier object (LMDB opens one environment
once per process), which writes the bytes and tells the index nothing, as that
process's writes do; tests/service/test_put_process.py has the real second process.
"""

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
    orphan = chain(2, seed=3)[1:]  # its parent is stored nowhere
    ticket, refs, _ = store.reserve_shm(_chunks(orphan), 30.0, worker=GEN)
    _fill(store, refs, orphan)
    writer.write(orphan)
    assert _in_lmdb(store, keys_of(orphan)) == {orphan[0].key}
    result = store.commit_shm(ticket, worker=GEN, persisted=keys_of(orphan))
    assert result.stored == 0 and result.rejected[0][1] == "parent is not stored"
    assert _in_lmdb(store, keys_of(orphan)) == set()
    assert store.index.used == [0, 0] and store._claims == {}


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
