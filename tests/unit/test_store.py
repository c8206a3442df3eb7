"""TieredStore over real shared memory and a real LMDB in a temp dir."""

import threading

import lmdb
import pytest

from kvstore.core.keys import Namespace
from kvstore.core.types import ChunkRecord, InvalidArgument, NotFound, TierFullError
from tests.chunks import chain, keys_of

MiB = 1 << 20


def test_put_then_lookup_and_get_return_the_exact_bytes(open_store):
    store = open_store(nvme_bytes=0)
    records = chain(4)
    result = store.put(records)
    assert (result.stored, result.duplicates, result.rejected) == (4, 0, [])
    found = store.lookup(keys_of(records) + [b"\x00" * 16])
    assert found.matched == 4 and found.tiers == ["dram"] * 4 and found.lease_id is None
    assert store.get(keys_of(records)) == [r.payload for r in records]
    assert store.put(records[:2]).duplicates == 2


def test_get_stops_at_the_first_missing_chunk(open_store):
    store = open_store(nvme_bytes=0)
    records = chain(4)
    store.put(records[:2])
    assert store.get(keys_of(records)) == [r.payload for r in records[:2]]
    assert store.lookup([records[1].key]).matched == 0  # a suffix alone is no prefix


def test_write_through_survives_a_restart(open_store):
    store = open_store()
    a, b = chain(5, seed=1), chain(3, seed=2)
    store.put(a)
    store.put(b)
    assert store.stats().tiers[1].chunks == 8
    store.close()
    again = open_store()
    assert again.lookup(keys_of(a)).tiers == ["nvme"] * 5
    assert again.get(keys_of(a)) == [r.payload for r in a]
    assert again.get(keys_of(b)) == [r.payload for r in b]
    # the hits were promoted
    assert again.lookup(keys_of(a)).tiers == ["dram"] * 5


def test_a_full_dram_demotes_to_nvme_and_loses_nothing(open_store):
    store = open_store(dram_slots=4, policy="none")
    records = chain(12)
    store.put(records)
    stats = store.stats()
    assert stats.tiers[0].chunks <= 4
    assert stats.tiers[0].evictions >= 8
    assert store.get(keys_of(records)) == [r.payload for r in records]


def test_a_flipped_byte_in_lmdb_is_a_miss_and_a_counter(open_store, tmp_path):
    store = open_store()
    records = chain(4)
    store.put(records)
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), map_size=64 * MiB)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(records[2].key))
        value[len(value) // 2] ^= 0xFF
        txn.put(records[2].key, bytes(value))
    env.close()
    again = open_store()
    for _ in range(2):
        got = again.get(keys_of(records))
        assert got == [r.payload for r in records[:2]]
    stats = again.stats()
    assert stats.tiers[1].corrupt == 1
    assert again.lookup(keys_of(records)).matched == 2


def test_a_full_lmdb_is_a_clear_error_and_keeps_what_was_stored(open_store):
    store = open_store(dram_slots=0, nvme_bytes=1 * MiB, high_watermark=1.0, low_watermark=1.0)
    stored = []
    with pytest.raises(TierFullError, match="full"):
        for seed in range(200):
            records = chain(2, seed=seed)
            store.put(records)
            stored.extend(records)
    assert stored
    for i in range(0, len(stored), 2):
        pair = stored[i : i + 2]
        assert store.get(keys_of(pair)) == [r.payload for r in pair]


def test_bad_chunks_are_rejected_with_reasons(open_store):
    store = open_store(nvme_bytes=0)
    records = chain(3)
    bad = ChunkRecord(records[0].key, None, records[0].ns, b"garbage")
    result = store.put([bad, records[1]])
    assert result.stored == 0
    assert [reason for _, reason in result.rejected] == [
        "bad payload: payload is 7 bytes, shorter than the 36-byte header",
        "parent was rejected",
    ]
    assert store.put([records[2]]).rejected == [(records[2].key, "parent is not stored")]
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.put([ChunkRecord(b"short", None, records[0].ns, records[0].payload)])
    assert store.stats().rejected == {
        "bad_payload": 1,
        "parent_rejected": 1,
        "parent_not_stored": 1,
    }


def test_leased_chunks_stay_and_a_full_store_says_so(open_store):
    store = open_store(dram_slots=4, nvme_bytes=0)
    records = chain(4)
    store.put(records)
    lease = store.lookup(keys_of(records), lease_ttl_s=30).lease_id
    with pytest.raises(TierFullError):
        store.put(chain(1, seed=9))
    assert store.get(keys_of(records)) == [r.payload for r in records]
    store.release(lease)
    assert store.put(chain(1, seed=9)).stored == 1
    with pytest.raises(NotFound):
        store.release(lease)


def test_delete_and_delete_namespace(open_store):
    store = open_store()
    a = chain(4, seed=1)
    other = Namespace("other-model", "r0", 2, 2, 64, 32, "raw")
    b = chain(2, seed=2, ns=other)
    store.put(a)
    store.put(b)
    assert store.delete([a[2].key]) == 2
    assert store.lookup(keys_of(a)).matched == 2
    assert store.delete_namespace(other.digest()) == 2
    assert store.lookup(keys_of(b)).matched == 0
    with pytest.raises(NotFound):
        store.delete_namespace(other.digest())
    store.close()
    again = open_store()
    assert again.lookup(keys_of(a)).matched == 2 and again.lookup(keys_of(b)).matched == 0


def test_write_back_persists_at_close(open_store):
    store = open_store(policy="write_back")
    records = chain(3)
    store.put(records)
    assert store.stats().tiers[1].chunks == 0
    store.close()
    again = open_store(policy="write_back")
    assert again.get(keys_of(records)) == [r.payload for r in records]


def test_concurrent_puts_and_gets_never_mix_bytes(open_store):
    store = open_store(dram_slots=16)
    chains = [chain(4, seed=s) for s in range(8)]
    errors = []

    def worker(records):
        try:
            for _ in range(5):
                store.put(records)
                got = store.get(keys_of(records))
                assert got == [r.payload for r in records][: len(got)]
        except Exception as exc:  # surfaced below with the thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for records in chains:
        assert store.get(keys_of(records)) == [r.payload for r in records]
