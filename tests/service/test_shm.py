"""The shared-memory data plane: Get with shm handles under a lease, same host."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvstore.client import ClientError, KVStoreClient
from kvstore.pb import pb
from kvstore.service import Limits
from tests.chunks import CHUNK_COST, chain
from tests.service.conftest import keys_of, payloads_of


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
        # the first read promoted them, so now they come as handles; bytes are the same
        assert c.lookup(keys_of(records)).tiers == ["dram"] * 3
        assert [bytes(p) for p in c.get(keys_of(records), shm=True)] == payloads_of(records)
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
