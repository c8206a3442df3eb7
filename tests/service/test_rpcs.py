"""Every RPC of kvstore.v1.KVStore, round trip, against a real server over DRAM + LMDB."""

from __future__ import annotations

import time

import grpc
import pytest

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.core.keys import Namespace
from kvstore.core.types import ChunkRecord
from tests.chunks import NAMESPACE, chain, payload
from tests.service.conftest import keys_of, payloads_of

OTHER = Namespace("other-model", "r0", 2, 2, 64, 32, "raw")


def test_put_streams_several_batches_and_counts_duplicates(served):
    records = chain(6, seed=1)
    # a batch limit below one payload puts every chunk in its own PutRequest message
    with KVStoreClient(served.address, ClientOptions(put_batch_bytes=1)) as one_per_message:
        result = one_per_message.put(records)
    assert (result.stored, result.duplicates, result.rejected) == (6, 0, [])
    assert served.store.stats().puts == 6  # six messages, each a store batch

    with KVStoreClient(served.address) as c:
        again = c.put(records[:4] + chain(2, seed=2))
        assert (again.stored, again.duplicates, again.rejected) == (2, 4, [])
        stats = c.stats()
    assert stats.put_chunks == 8 and stats.put_duplicates == 4 and stats.chunks == 8


def test_put_rejects_chunks_with_reasons_and_stores_the_rest(client):
    records = chain(3, seed=3)
    orphan = chain(3, seed=4)[2]  # its parent was never stored
    corrupt = bytearray(records[2].payload)
    corrupt[-1] ^= 0xFF
    bad = ChunkRecord(records[2].key, records[2].parent, records[2].ns, bytes(corrupt))

    result = client.put([records[0], records[1], orphan, bad])

    assert result.stored == 2 and result.duplicates == 0
    assert result.rejected == [
        (orphan.key, "parent is not stored"),
        (bad.key, "bad payload: checksum mismatch: the payload was corrupted"),
    ]
    assert client.lookup(keys_of(records)).matched == 2
    assert client.stats().rejected == {"parent_not_stored": 1, "bad_payload": 1}


def test_lookup_reports_matched_prefix_tiers_and_lease(client):
    records = chain(4, seed=5)
    client.put(records[:3])

    plain = client.lookup(keys_of(records))
    assert (plain.matched, plain.tiers, plain.lease_id) == (3, ["dram"] * 3, None)
    assert client.lookup([records[1].key]).matched == 0  # a suffix alone is no prefix

    leased = client.lookup(keys_of(records), lease_ttl_s=30)
    assert leased.matched == 3 and leased.lease_id
    assert client.stats().active_leases == 1
    client.release(leased.lease_id)
    assert client.stats().active_leases == 0


def test_get_returns_the_put_bytes_in_key_order_and_stops_at_the_first_gap(client):
    records = chain(5, seed=6)
    client.put(records)
    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)

    client.delete([records[3].key])  # removes chunks 3 and 4
    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records[:3])
    # a key list that breaks the chain stops there even if later keys are stored
    broken = [records[0].key, b"\x00" * 16, records[2].key]
    assert [bytes(p) for p in client.get(broken)] == payloads_of(records[:1])
    assert client.get([records[1].key]) == []


def test_get_reads_chunks_that_only_lmdb_holds_after_a_restart(serve, open_store, tmp_path):
    records = chain(4, seed=7)
    first = serve(open_store(path=tmp_path / "db"))
    with KVStoreClient(first.address) as c:
        c.put(records)
    first.server.stop()

    second = serve(open_store(path=tmp_path / "db"))
    with KVStoreClient(second.address) as c:
        assert c.lookup(keys_of(records)).tiers == ["nvme"] * 4
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
        assert c.lookup(keys_of(records)).tiers == ["dram"] * 4  # promoted


def test_release_ends_a_lease_and_a_second_release_is_not_found(client):
    records = chain(2, seed=8)
    client.put(records)
    lease = client.lookup(keys_of(records), lease_ttl_s=10).lease_id
    client.release(lease)
    with pytest.raises(ClientError) as err:
        client.release(lease)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert str(lease) in err.value.details


def test_delete_by_keys_by_namespace_and_neither(client):
    a = chain(4, seed=9)
    b = chain(3, seed=10, ns=OTHER)
    client.put(a)
    client.put(b)

    assert client.delete([a[2].key]) == 2  # the chunk and its suffix
    assert client.lookup(keys_of(a)).matched == 2
    assert client.delete([a[3].key]) == 0  # already gone

    assert client.delete(namespace=OTHER.digest()) == 3
    assert client.lookup(keys_of(b)).matched == 0
    assert dict(client.stats().namespaces) == {NAMESPACE.digest().hex(): 2}

    with pytest.raises(ClientError) as err:
        client.delete()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "keys or a namespace" in err.value.details


def test_stats_after_known_traffic(client):
    a = chain(3, seed=11)
    b = chain(2, seed=12, ns=OTHER)
    client.put(a)
    client.put(b)
    client.put(a[:1])  # one duplicate
    client.lookup(keys_of(a) + [b"\x01" * 16])  # 4 keys, 3 hits
    client.get(keys_of(a))  # 3 DRAM hits

    s = client.stats()
    assert s.chunks == 5 and s.put_chunks == 5 and s.put_duplicates == 1
    assert (s.lookups, s.lookup_keys, s.lookup_hit_keys) == (1, 4, 3)
    assert dict(s.namespaces) == {NAMESPACE.digest().hex(): 3, OTHER.digest().hex(): 2}
    dram, nvme = s.tiers
    assert (dram.name, dram.chunks, dram.hits) == ("dram", 5, 3)
    assert dram.bytes_out == sum(len(r.payload) for r in a)
    assert (nvme.name, nvme.chunks, nvme.hits) == ("nvme", 5, 0)  # write_through
    assert s.write_policy == "write_through" and s.active_leases == 0
    assert s.version and s.uptime_s > 0


def test_explain_complete_never_stored_deleted_and_namespace_unknown(client):
    a = chain(4, seed=13)
    client.put(a)

    e = client.explain(keys_of(a))
    assert (e.matched, e.reason, list(e.tiers)) == (4, "complete", ["dram"] * 4)

    e = client.explain(keys_of(a) + keys_of(chain(1, seed=99)))
    assert (e.matched, e.reason) == (4, "never_stored")

    client.delete([a[1].key])
    e = client.explain(keys_of(a))
    assert (e.matched, e.reason) == (1, "deleted")
    assert a[1].key.hex() in e.detail

    unknown = chain(2, seed=14, ns=OTHER)
    e = client.explain(keys_of(unknown), namespace=OTHER.digest())
    assert (e.matched, e.reason) == (0, "namespace_unknown")
    assert OTHER.digest().hex() in e.detail
    # the same keys under a namespace that has chunks are just never stored
    e = client.explain(keys_of(unknown), namespace=NAMESPACE.digest())
    assert e.reason == "never_stored"
    assert client.explain([]).reason == "empty"


def test_explain_names_eviction_from_a_tiny_dram_only_store(serve, open_store):
    served = serve(open_store(dram_slots=4, nvme_bytes=0))
    a, b = chain(2, seed=15), chain(3, seed=16)
    with KVStoreClient(served.address) as c:
        c.put(a)
        c.put(b)  # four slots: the older chain a is evicted, leaf first
        assert c.lookup(keys_of(b)).matched == 3
        e = c.explain(keys_of(a))
    assert (e.matched, e.reason, e.tier) == (0, "evicted", "dram")
    assert e.seconds_ago >= 0 and "evicted" in e.detail


def test_explain_notes_an_expired_lease(client):
    a = chain(2, seed=17)
    client.put(a)
    lease = client.lookup(keys_of(a), lease_ttl_s=0.05).lease_id
    time.sleep(0.15)
    client.delete([a[1].key])
    e = client.explain(keys_of(a), lease_id=lease)
    assert (e.matched, e.reason) == (1, "deleted")
    assert f"Lease {lease} expired" in e.detail
    assert client.stats().expired_leases == 1
    # a live lease is not mentioned
    live = client.lookup(keys_of(a), lease_ttl_s=30).lease_id
    assert "expired" not in client.explain(keys_of(a), lease_id=live).detail


def test_put_of_a_payload_for_the_chunk_key_round_trips_byte_for_byte(client):
    # distinct payloads under one chain: the store never mixes chunks up
    records = chain(8, seed=18)
    client.put(records)
    got = client.get(keys_of(records))
    assert [bytes(p) for p in got] == payloads_of(records)
    assert bytes(got[0]) == payload(18 * 1000)
