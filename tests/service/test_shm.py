"""The shared-memory data plane: Get with shm handles under a lease, same host. The
``client`` fixture here makes the tests run twice: with ``Lookup`` and ``GetShm`` over the
store's same-host socket (the default) and over gRPC."""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time

import grpc
import pytest
import torch

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.client.shm_reader import ShmReader
from kvstore.rpc.pb import pb
from kvstore.server.service import KVStoreService, Limits
from tests.chunks import CHUNK_COST, chain
from tests.service.conftest import keys_of, payloads_of
from tests.shm_regions import mapped_here, resident_kib


@pytest.fixture(params=["local", "grpc"])
def client(served, request):
    options = ClientOptions(timeout_s=10.0, local_calls=request.param == "local")
    with KVStoreClient(served.address, options) as c:
        yield c


def read_region(handle: pb.ShmHandle) -> bytes:
    with open(f"/dev/shm/{handle.region}", "rb") as f:
        f.seek(handle.offset)
        return f.read(handle.length)


def test_shm_get_returns_the_put_bytes_and_releases_its_lease(client, served):
    records = chain(4, seed=1)
    client.put(records)

    got = client.get(keys_of(records), shm=True)

    assert [bytes(p) for p in got] == payloads_of(records)
    assert client.stats().active_leases == 0
    assert served.store.stats().tiers[0].hits == 4
    # every copy checked out (key, length, lease), so none was read again over TCP
    assert (client.shm_stats.chunks, client.shm_stats.dropped) == (4, 0)


def test_get_shm_into_fills_torch_tensors(client):
    records = chain(3, seed=2)
    client.put(records)
    dests = [torch.zeros(len(r.payload) + 8, dtype=torch.uint8) for r in records]

    copied = client.get_shm_into(keys_of(records) + [b"\x07" * 16], dests + [dests[0]])

    assert copied == 3
    for dest, rec in zip(dests, records):
        assert bytes(dest[: len(rec.payload)].numpy()) == rec.payload
        assert not dest[len(rec.payload) :].any()
    assert client.stats().active_leases == 0


def _held_releases(monkeypatch, store) -> threading.Event:
    """Make the store's Release wait until the returned event is set."""
    go, real = threading.Event(), store.release

    def release(lease_id):
        assert go.wait(10)
        return real(lease_id)

    monkeypatch.setattr(store, "release", release)
    return go


@pytest.mark.parametrize("into", [False, True], ids=["get", "get_shm_into"])
def test_a_copy_made_well_inside_its_lease_does_not_wait_for_the_release(
    served, client, monkeypatch, into
):
    """The store keeps leased bytes for the granted TTL from when it granted the lease,
    so a copy that ended within half of it is trusted and the Release is sent without
    waiting for its answer (one round trip less per read)."""
    records = chain(3, seed=4)
    client.put(records)
    go = _held_releases(monkeypatch, served.store)

    got = read_shm(client, records, into)  # would block here if it waited for Release

    assert got == payloads_of(records)
    assert served.store.stats().active_leases == 1  # its Release is still held up
    go.set()
    assert client.stats().active_leases == 0  # stats() waits for the client's releases
    assert (client.shm_stats.chunks, client.shm_stats.dropped) == (3, 0)


def test_a_store_that_does_not_say_its_lease_length_is_asked_before_a_copy_is_kept(
    serve, monkeypatch
):
    """Stores before ``ShmBatch.lease_ttl_s`` answer 0: the client must wait for Release."""
    real_get_shm = KVStoreService.GetShm

    def old_store(self, request, context):
        batch = real_get_shm(self, request, context)
        batch.lease_ttl_s = 0.0
        return batch

    monkeypatch.setattr(KVStoreService, "GetShm", old_store)
    served = serve()
    records = chain(2, seed=5)
    with KVStoreClient(served.address, ClientOptions(timeout_s=10.0)) as client:
        client.put(records)
        go = _held_releases(monkeypatch, served.store)
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(read_shm(client, records, False)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not got  # waiting for the Release answer
        go.set()
        reader.join(10)
        assert got == payloads_of(records)
        assert served.store.stats().active_leases == 0


def test_a_server_without_shm_refuses_shm_gets(serve):
    served = serve(limits=Limits(shm=False))
    records = chain(2, seed=3)
    with KVStoreClient(served.address) as c:
        c.put(records)
        with pytest.raises(ClientError) as err:
            c.get(keys_of(records), shm=True)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "shm" in err.value.details
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
        assert c.stats().active_leases == 0


def test_chunks_only_lmdb_holds_come_back_as_bytes_in_shm_mode(
    serve, open_store, tmp_path, raw_stub
):
    records = chain(3, seed=4)
    first = serve(open_store(path=tmp_path / "db"))
    with KVStoreClient(first.address) as c:
        c.put(records)
    first.server.stop()

    second = serve(open_store(path=tmp_path / "db"))
    batch = raw_stub(second.address).get_shm(pb.GetShmRequest(keys=keys_of(records)))
    assert (batch.matched, len(batch.handles), batch.lease_id) == (3, 0, 0)
    assert second.store.stats().active_leases == 0  # no handle, so no lease left behind

    with KVStoreClient(second.address) as c:
        # GetShm read nothing it could not hand out (the client fetches those over Get,
        # which reads them once and promotes them)
        assert c.lookup(keys_of(records)).tiers == ["nvme"] * 3
        assert second.store.stats().tiers[1].hits == 0
        assert [bytes(p) for p in c.get(keys_of(records), shm=True)] == payloads_of(records)
        assert second.store.stats().tiers[1].hits == 3
        # promoted by that read, so now they come as handles; bytes are the same
        assert c.lookup(keys_of(records)).tiers == ["dram"] * 3
        assert [bytes(p) for p in c.get(keys_of(records), shm=True)] == payloads_of(records)
        assert c.shm_stats.chunks == 3
        # no lease is left behind by either read
        assert c.stats().active_leases == 0


def test_a_deleted_chunk_keeps_its_slot_until_the_shm_lease_ends(serve, open_store, raw_stub):
    # five slots: chain a takes three, two stay free
    served = serve(open_store(dram_slots=5))
    dram = served.store.tiers[0]
    a, b, c = chain(3, seed=5), chain(3, seed=6), chain(3, seed=7)
    stub = raw_stub(served.address)
    with KVStoreClient(served.address) as client:
        client.put(a)
        batch = stub.get_shm(pb.GetShmRequest(keys=keys_of(a), lease_ttl_s=30))
        handles = list(batch.handles)
        assert len(handles) == 3 and all(h.region == dram.region_name for h in handles)
        lease = batch.lease_id
        assert lease

        assert client.delete([a[0].key]) == 3
        assert client.lookup(keys_of(a)).matched == 0
        # b needs three new slots: if a's were free again, b[2] would take one of them
        client.put(b)
        assert dram.free_bytes == 0
        assert [read_region(h) for h in handles] == payloads_of(a)
        # the index counts a's held slots, so b made room by demoting its oldest chunk
        assert client.lookup(keys_of(b)).tiers == ["nvme", "dram", "dram"]

        stub.release(pb.ReleaseRequest(lease_id=lease))
        assert dram.free_bytes == 3 * CHUNK_COST
        client.put(c)
        c_batch = stub.get_shm(pb.GetShmRequest(keys=keys_of(c)))
        c_handles = list(c_batch.handles)
        assert {h.offset for h in c_handles} & {h.offset for h in handles}  # slots reused
        assert [read_region(h) for h in c_handles] == payloads_of(c)
        stub.release(pb.ReleaseRequest(lease_id=c_batch.lease_id))
        assert client.stats().active_leases == 0


def test_a_read_that_cannot_promote_still_returns_the_bytes(serve, open_store, raw_stub):
    served = serve(open_store(dram_slots=5))
    a, b = chain(3, seed=8), chain(3, seed=9)
    stub = raw_stub(served.address)
    with KVStoreClient(served.address) as client:
        client.put(a)
        first = stub.get_shm(pb.GetShmRequest(keys=keys_of(a), lease_ttl_s=30))
        client.delete([a[0].key])
        client.put(b)  # only two slots are free: b's oldest chunk is demoted to LMDB
        assert client.lookup(keys_of(b)).tiers == ["nvme", "dram", "dram"]
        assert [bytes(p) for p in client.get(keys_of(b))] == payloads_of(b)
        stub.release(pb.ReleaseRequest(lease_id=first.lease_id))


def answer_after_the_lease_lapses(monkeypatch, store, meanwhile) -> list:
    """The next GetShm reaches its client only after its lease lapsed and ``meanwhile()``
    ran, as for a client slower than its lease; returns the refs that answer gave."""
    real = store.get_shm
    given: list = []

    def late(keys, lease_ttl_s, **kw):
        lease_id, refs = real(keys, lease_ttl_s, **kw)
        if not kw.get("views") and not given:  # GetShm, not Get (which streams the views)
            given.extend(refs)
            time.sleep(lease_ttl_s + 0.05)
            meanwhile()
        return lease_id, refs

    monkeypatch.setattr(store, "get_shm", late)
    return given


def read_shm(client: KVStoreClient, records, into: bool) -> list[bytes]:
    """The stored prefix of ``records`` through ``get(shm=True)`` or ``get_shm_into``."""
    if not into:
        return [bytes(p) for p in client.get(keys_of(records), shm=True)]
    dests = [torch.zeros(len(r.payload), dtype=torch.uint8) for r in records]
    n = client.get_shm_into(keys_of(records), dests)
    return [bytes(d.numpy()) for d in dests[:n]]


SLOW_READER = ClientOptions(timeout_s=10.0, shm_lease_ttl_s=0.05)


@pytest.mark.parametrize("into", [False, True], ids=["get", "get_shm_into"])
def test_a_copy_from_slots_reused_after_the_lease_lapsed_is_read_again(
    serve, open_store, monkeypatch, into
):
    served = serve(open_store(dram_slots=8))
    a, b = chain(3, seed=20), chain(16, seed=21)
    given = answer_after_the_lease_lapses(monkeypatch, served.store, lambda: served.store.put(b))
    with KVStoreClient(served.address, SLOW_READER) as client:
        client.put(a)
        assert client.lookup(keys_of(a)).tiers == ["dram"] * 3

        got = read_shm(client, a, into)

        # b filled the dram tier while the answer was on its way: a's handles hold b's bytes
        assert len(given) == 3
        assert all(read_region(ref) not in payloads_of(a) for ref in given)
        assert got == payloads_of(a)  # from LMDB, over TCP
        stats = client.shm_stats
        assert (stats.chunks, stats.dropped, stats.lease_lapsed, stats.key_mismatch) == (0, 3, 3, 3)
        assert client.stats().active_leases == 0


@pytest.mark.parametrize("into", [False, True], ids=["get", "get_shm_into"])
def test_a_lapsed_copy_of_chunks_deleted_meanwhile_counts_only_the_rest(
    serve, open_store, monkeypatch, into
):
    served = serve(open_store(dram_slots=8))
    a, b = chain(4, seed=22), chain(16, seed=23)

    def delete_then_refill() -> None:
        served.store.delete([a[2].key])  # a[2] and a[3]
        served.store.put(b)

    answer_after_the_lease_lapses(monkeypatch, served.store, delete_then_refill)
    with KVStoreClient(served.address, SLOW_READER) as client:
        client.put(a)
        assert client.lookup(keys_of(a)).tiers == ["dram"] * 4

        got = read_shm(client, a, into)

        assert got == payloads_of(a)[:2]
        assert client.shm_stats.dropped == 4


def test_a_lapsed_lease_is_not_trusted_even_when_the_bytes_still_match(
    serve, open_store, monkeypatch
):
    served = serve(open_store(dram_slots=8))
    a = chain(3, seed=24)
    # nothing overwrites the slots; stats() just lets the store notice the lease expired
    answer_after_the_lease_lapses(monkeypatch, served.store, served.store.stats)
    with KVStoreClient(served.address, SLOW_READER) as client:
        client.put(a)
        assert client.lookup(keys_of(a)).tiers == ["dram"] * 3

        assert read_shm(client, a, into=False) == payloads_of(a)

        stats = client.shm_stats
        assert (stats.chunks, stats.dropped, stats.lease_lapsed, stats.key_mismatch) == (0, 3, 3, 0)
        assert served.store.stats().expired_leases == 1


def test_the_lease_ttl_option_must_be_a_positive_number():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="shm_lease_ttl_s"):
            ClientOptions(shm_lease_ttl_s=bad)


def test_a_region_that_cannot_be_mapped_is_read_over_tcp(serve, open_store):
    served = serve(open_store(dram_slots=8))
    a = chain(3, seed=25)
    with KVStoreClient(served.address) as client:
        client.put(a)
        os.unlink(f"/dev/shm/{served.store.tiers[0].region_name}")

        assert read_shm(client, a, into=True) == payloads_of(a)

        stats = client.shm_stats
        assert (stats.chunks, stats.dropped, stats.region_unavailable) == (0, 3, 3)
        assert client.stats().active_leases == 0


@pytest.fixture
def make_region():
    """``make_region(chunks) -> (name, handles)``: a real /dev/shm file laid out as the dram
    tier lays chunks out (each key just before its payload), removed at teardown."""
    paths: list[str] = []

    def _make(chunks: list[tuple[bytes, bytes]]) -> tuple[str, list[pb.ShmHandle]]:
        name = f"kvtest-{secrets.token_hex(6)}"  # not kvstore-: no store may reclaim it
        path = f"/dev/shm/{name}"
        paths.append(path)
        handles = []
        with open(path, "wb") as f:
            for key, payload in chunks:
                f.write(key)
                handles.append(pb.ShmHandle(region=name, offset=f.tell(), length=len(payload)))
                f.write(payload + bytes(-len(payload) % 512))
        return name, handles

    yield _make
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def copy_all(reader: ShmReader, keys, handles) -> tuple[set[int], dict[int, bytes]]:
    out: dict[int, bytes] = {}

    def copy(i: int, src: memoryview) -> None:
        out[i] = bytes(src)

    return reader.copy_out(keys, handles, copy), out


def test_the_reader_keeps_only_copies_of_the_key_asked_for_and_of_the_right_length(make_region):
    a, b = chain(2, seed=26)
    name, (ha, hb) = make_region([(a.key, a.payload), (b.key, b.payload)])
    reader = ShmReader()
    try:
        assert copy_all(reader, [a.key, b.key], [ha, hb]) == (
            set(),
            {0: a.payload, 1: b.payload},
        )
        # the slot holds b: a copy made for a's key is not kept
        assert copy_all(reader, [a.key], [hb])[0] == {0}
        assert reader.stats.key_mismatch == 1
        short = pb.ShmHandle(region=name, offset=ha.offset, length=ha.length - 1)
        no_key = pb.ShmHandle(region=name, offset=0, length=ha.length)
        past_end = pb.ShmHandle(region=name, offset=hb.offset, length=hb.length + 4096)
        bad, out = copy_all(reader, [a.key, a.key, b.key], [short, no_key, past_end])
        assert bad == {0, 1, 2} and reader.stats.bad_length == 3
        assert set(out) == {0}  # handles outside the region are not even copied
    finally:
        reader.close()


def test_the_reader_unmaps_a_region_once_the_store_names_another(make_region):
    a, b = chain(2, seed=27)
    old, (ha,) = make_region([(a.key, a.payload)])
    new, (hb,) = make_region([(b.key, b.payload)])
    reader = ShmReader()
    try:
        kept: list[memoryview] = []
        assert reader.copy_out([a.key], [ha], lambda i, src: kept.append(src)) == set()
        assert reader.mapped() == [old] and old in mapped_here()

        # a restarted store names a new region; a caller still holds a view of the old one
        assert copy_all(reader, [b.key], [hb]) == (set(), {0: b.payload})
        assert reader.mapped() == [new]
        assert old in mapped_here()  # the view keeps it mapped ...
        kept.clear()
        assert old not in mapped_here()  # ... until it goes

        gone = pb.ShmHandle(region="kvtest-gone", offset=16, length=hb.length)
        odd = pb.ShmHandle(region="../shm/" + new, offset=16, length=hb.length)
        assert copy_all(reader, [b.key, b.key], [gone, gone])[0] == {0, 1}
        assert copy_all(reader, [b.key], [odd])[0] == {0}
        assert reader.stats.region_unavailable == 3 and reader.stats.regions_mapped == 2
        assert new not in mapped_here()
    finally:
        reader.close()


def test_the_reader_maps_the_whole_region_into_its_page_tables_at_once(make_region):
    """Loads must not fault each page in on first read: the region's pages are mapped in
    the background as soon as the region is, without a copy of their bytes."""
    a, b = chain(2, seed=28)
    pad = 8 << 20  # far more than the chunks read: only prefaulting maps it
    name, (ha, _) = make_region([(a.key, a.payload), (b.key, b.payload + bytes(pad))])
    reader = ShmReader()
    try:
        assert copy_all(reader, [a.key], [ha]) == (set(), {0: a.payload})
        assert reader.prefault is not None
        reader.prefault.join(10)
        assert resident_kib(name) * 1024 >= pad
    finally:
        reader.close()


# ---- a leased lookup's shared-memory handles (a same-host reader needs no GetShm) ----


def test_a_leased_lookup_on_the_stores_host_says_where_its_chunks_lie(client, served):
    records = chain(4, seed=40)
    client.put(records)
    keys = keys_of(records) + [b"\x09" * 16]

    res = client.lookup(keys, lease_ttl_s=5.0, shm=True)

    assert res.matched == 4 and res.shm is not None and res.shm.lease_id == res.lease_id
    assert res.shm.lease_ttl_s == 5.0 and 0 < res.shm.sent <= time.monotonic()
    got = [read_region(pb.ShmHandle(region=r, offset=o, length=n)) for r, o, n in res.shm.handles]
    assert got == payloads_of(records)
    assert served.store.stats().tiers[0].hits == 4  # handed out: counted as GetShm counts
    # no lease asked for, or no handles asked for: none given
    assert client.lookup(keys, shm=True).shm is None
    assert client.lookup(keys, lease_ttl_s=5.0).shm is None
    assert client.stats().active_leases == 2


def test_a_store_without_shm_answers_a_lookup_that_asks_for_handles_without_them(serve):
    served = serve(limits=Limits(shm=False))
    records = chain(2, seed=41)
    with KVStoreClient(served.address) as client:
        client.put(records)
        res = client.lookup(keys_of(records), lease_ttl_s=5.0, shm=True)
        assert (res.matched, res.shm) == (2, None) and res.lease_id


def test_views_under_a_lookups_grant_send_no_getshm_and_end_its_lease(client, served):
    records = chain(4, seed=42)
    client.put(records)
    keys = keys_of(records)
    grant = client.lookup(keys, lease_ttl_s=5.0, shm=True).shm

    def no_getshm(*args, **kwargs):
        raise AssertionError("GetShm sent although the lookup's handles were fresh")

    with KVStoreClient(served.address) as reader:  # another client, as a worker would be
        reader._get_shm_leased = no_getshm
        views = reader.shm_views(keys[:3], grant=grant)
        assert [bytes(v) for v in views.views] == payloads_of(records)[:3]
        assert views.end() == 3
        assert reader.shm_stats.grants_used == 1
        assert reader.stats().active_leases == 0  # the lookup's lease, ended by the reader


def test_a_stale_or_short_grant_is_passed_over_and_its_lease_still_ended(client, served):
    records = chain(3, seed=43)
    client.put(records)
    keys = keys_of(records)
    short = client.lookup(keys[:2], lease_ttl_s=5.0, shm=True).shm
    old = client.lookup(keys, lease_ttl_s=5.0, shm=True).shm
    stale = dataclasses.replace(old, sent=old.sent - 5.0)  # asked 5 s ago: past its freshness
    for grant in (short, stale):
        views = client.shm_views(keys, grant=grant)  # read under a GetShm lease instead
        assert [bytes(v) for v in views.views] == payloads_of(records)
        assert views.end() == 3
    assert client.shm_stats.grants_unused == 2 and client.shm_stats.grants_used == 0
    assert client.stats().active_leases == 0


def test_a_grant_whose_slot_was_reused_is_not_trusted(client, served):
    records = chain(2, seed=44)
    client.put(records)
    keys = keys_of(records)
    grant = client.lookup(keys, lease_ttl_s=5.0, shm=True).shm
    views = client.shm_views(keys, grant=grant)
    region, offset, _ = grant.handles[1]
    with open(f"/dev/shm/{region}", "r+b") as f:  # as a store reusing the slot would
        f.seek(offset - 16)
        f.write(b"\xee" * 16)
    assert views.end() == 1 and client.shm_stats.key_mismatch == 1
