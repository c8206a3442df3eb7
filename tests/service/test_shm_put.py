"""Same-host puts: the client copies each payload straight into the store's shared
memory and commits; the commit validates exactly like Put, and room never committed
lapses. Real server on loopback, real shared memory, real LMDB. The ``client`` fixture
here makes the tests run twice: with the put's two calls over the store's same-host
socket (the default) and over gRPC."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvstore.client import ClientOptions, KVStoreClient, shm_writer
from kvstore.core import codec, regions
from kvstore.core.types import ChunkRecord, InvalidArgument
from kvstore.rpc.pb import pb
from kvstore.server.service_calls import Limits
from tests.chunks import CHUNK_COST, SHAPE, chain
from tests.service.conftest import keys_of, payloads_of


@pytest.fixture(params=["local", "grpc"])
def client(served, request):
    options = ClientOptions(timeout_s=10.0, local_calls=request.param == "local")
    with KVStoreClient(served.address, options) as c:
        yield c


def test_a_same_host_put_lands_in_dram_and_lmdb_byte_for_byte(client, served):
    records = chain(4, seed=30)
    result = client.put(records, shm=True)
    assert (result.stored, result.duplicates, result.rejected) == (4, 0, [])
    assert client.lookup(keys_of(records)).tiers == ["dram"] * 4
    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
    stats = client.stats()
    assert stats.tiers[1].chunks == 4  # written through, as any put
    assert stats.put_chunks == 4
    again = client.put(records, shm=True)  # held already: nothing is sent or written
    assert (again.stored, again.duplicates) == (0, 4)


def test_a_corrupt_payload_written_in_place_is_rejected_and_its_room_given_back(served, raw_stub):
    dram = served.store.tiers[0]
    free = dram.free_bytes
    (rec,) = chain(1, seed=31)
    stub = raw_stub(served.address)
    channel_stub = stub.channel.unary_unary(
        "/kvstore.v1.KVStore/ReserveShm",
        pb.ReserveShmRequest.SerializeToString,
        pb.ShmReservation.FromString,
    )
    grant = channel_stub(
        pb.ReserveShmRequest(
            chunks=[pb.ShmPutChunk(key=rec.key, namespace=rec.ns, length=len(rec.payload))]
        )
    )
    (handle,) = grant.handles
    assert handle.region == dram.region_name and dram.free_bytes == free - CHUNK_COST
    garbled = bytearray(rec.payload)
    garbled[-1] ^= 0xFF  # the checksum will not match
    with open(f"/dev/shm/{handle.region}", "r+b") as f:
        f.seek(handle.offset)
        f.write(garbled)
    commit = stub.channel.unary_unary(
        "/kvstore.v1.KVStore/CommitShm",
        pb.CommitShmRequest.SerializeToString,
        pb.PutResponse.FromString,
    )
    resp = commit(pb.CommitShmRequest(ticket=grant.ticket))
    assert resp.stored == 0 and "checksum" in resp.rejected[0].reason
    assert dram.free_bytes == free  # the room came back
    with KVStoreClient(served.address) as c:
        assert c.lookup([rec.key]).matched == 0


def test_room_never_committed_lapses(serve, open_store):
    served = serve(open_store())
    dram = served.store.tiers[0]
    free = dram.free_bytes
    records = chain(2, seed=32)
    ticket, refs, _ = served.store.reserve_shm(
        [(r.key, r.parent, r.ns, len(r.payload)) for r in records], ttl_s=0.05
    )
    assert ticket and all(refs) and dram.free_bytes < free
    time.sleep(0.1)
    # the next writer gives the lapsed room back before making its own
    with KVStoreClient(served.address) as c:
        assert c.put(chain(1, seed=33)).stored == 1
    assert dram.free_bytes == free - CHUNK_COST
    assert served.store.index.used[0] == CHUNK_COST


def test_chunks_without_room_go_over_put(serve, open_store):
    served = serve(open_store(dram_slots=2))
    records = chain(5, seed=34)
    with KVStoreClient(served.address) as c:
        result = c.put(records, shm=True)
        assert (result.stored, result.rejected) == (5, [])
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_a_record_that_does_not_match_its_room_is_sent_over_put(client):
    (rec,) = chain(1, seed=35)
    short = ChunkRecord(rec.key, None, rec.ns, rec.payload)
    assert client.put([short], shm=True).stored == 1
    assert [bytes(p) for p in client.get([rec.key])] == [rec.payload]


def test_room_committed_unwritten_never_publishes_the_bytes_left_in_it(client, served):
    """Freed room keeps its last chunk's bytes. A writer given that room that commits
    without writing (it could not map the region, say) must be refused, not have the old
    chunk's bytes, checksum and all, published under its own key."""
    old, new = chain(1, seed=36)[0], chain(1, seed=37)[0]
    assert len(old.payload) == len(new.payload) and old.payload != new.payload
    assert client.put([old], shm=True).stored == 1
    dram = served.store.tiers[0]
    old_at = dram._table.lookup(old.key).payload_offset
    assert client.delete([old.key]) == 1
    ticket, refs, _ = served.store.reserve_shm([(new.key, None, new.ns, len(new.payload))], 30.0)
    assert refs[0].offset == old_at  # the same room, the old bytes still in it
    result = served.store.commit_shm(ticket)
    assert result.stored == 0 and "bad payload" in result.rejected[0][1]
    assert client.lookup([new.key]).matched == 0
    assert client.put([new], shm=True).stored == 1  # a real write of the room then works
    assert [bytes(p) for p in client.get([new.key])] == [new.payload]


def test_a_client_that_cannot_map_the_region_stores_the_right_bytes_over_put(
    client, served, monkeypatch, tmp_path
):
    """The rooms it is given still hold an earlier chain's chunks (same sizes, same
    places); it commits them unwritten, then sends everything over Put. Every chunk must
    read back as its own bytes, counted once."""
    earlier, records = chain(3, seed=38), chain(3, seed=39)
    assert client.put(earlier, shm=True).stored == 3
    assert client.delete(keys_of(earlier)) == 3
    monkeypatch.setattr(regions, "SHM_DIR", str(tmp_path))  # the region is not there
    shm_writer.close_region(client)  # nor mapped already from the first put
    result = client.put(records, shm=True)
    assert (result.stored, result.duplicates, result.rejected) == (3, 0, [])
    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
    assert served.store.tiers[0].free_bytes == served.store.tiers[0].capacity_bytes - 3 * CHUNK_COST


def test_a_key_reserved_twice_gets_one_room_and_both_writers_store_it(client, served):
    """Two engines saving the same shared-prefix chunk at once: the second is given no
    room (it sends the chunk over Put), so neither room can be freed from under the other."""
    (rec,) = chain(1, seed=40)
    dram = served.store.tiers[0]
    free = dram.free_bytes
    first, refs_a, _ = served.store.reserve_shm([(rec.key, None, rec.ns, len(rec.payload))], 30.0)
    second, refs_b, _ = served.store.reserve_shm([(rec.key, None, rec.ns, len(rec.payload))], 30.0)
    assert refs_a[0] is not None and (second, refs_b) == (None, [None])
    assert client.put([rec]).stored == 1  # the second writer, over Put
    region = shm_writer._Region(dram.region_name)
    try:
        handle = pb.ShmHandle(offset=refs_a[0].offset, length=refs_a[0].length)
        assert region.write_all([(handle, rec)], time.monotonic() + 30) == [True]
    finally:
        region.close()
    result = served.store.commit_shm(first)
    assert (result.stored, result.duplicates) == (0, 1)
    assert dram.free_bytes == free - CHUNK_COST  # one copy held, the spare room back
    assert [bytes(p) for p in client.get([rec.key])] == [rec.payload]


def test_a_reservation_that_fails_midway_gives_back_what_it_took(served, monkeypatch):
    """An eviction that fails on the third chunk (a failing disk, say) must not leave the
    first two chunks' room staged and charged forever."""
    dram = served.store.tiers[0]
    free, used = dram.free_bytes, served.store.index.used[0]
    records = chain(3, seed=41)
    execute = served.store._mover.execute
    calls = []

    def failing_execute(plan):  # stands in for an eviction whose disk write fails
        calls.append(plan)
        if len(calls) == 3:
            raise OSError("injected: the disk under the eviction failed")
        return execute(plan)

    monkeypatch.setattr(served.store._mover, "execute", failing_execute)
    chunks = [(r.key, r.parent, r.ns, len(r.payload)) for r in records]
    with pytest.raises(OSError, match="injected"):
        served.store.reserve_shm(chunks, 30.0)
    assert (dram.free_bytes, served.store.index.used[0]) == (free, used)
    assert not dram._staged and not served.store._tickets
    bad_parent = [chunks[0], (chunks[1][0], b"short", chunks[1][2], chunks[1][3])]
    with pytest.raises(InvalidArgument, match="parent"):
        served.store.reserve_shm(bad_parent, 30.0)
    assert dram.free_bytes == free and not dram._staged


def test_a_writer_too_slow_for_its_reservation_writes_nothing_and_uses_put(
    serve, open_store, monkeypatch
):
    """A writer that stalls after checking its rooms' keys and before copying (swapped
    out, stopped) finds its room lapsed and given to another chunk: it must not write
    over that chunk, and must still store each of its own chunks, once."""
    served = serve(open_store(), limits=Limits(default_lease_ttl_s=0.05))
    records = chain(3, seed=42)
    others = chain(3, seed=43)  # the same sizes: they take the lapsed room
    copy = shm_writer.spread

    def stalled_copy(calls, weights):
        time.sleep(0.1)  # the stall: the reservation lapses meanwhile
        with KVStoreClient(served.address) as other:
            assert other.put(others).stored == 3  # gives back the lapsed room, takes it
        return copy(calls, weights)

    monkeypatch.setattr(shm_writer, "spread", stalled_copy)
    dram = served.store.tiers[0]
    with KVStoreClient(served.address) as c:
        result = c.put(records, shm=True)
        assert (result.stored, result.duplicates, result.rejected) == (3, 0, [])
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
        assert [bytes(p) for p in c.get(keys_of(others))] == payloads_of(others)
    assert not dram._staged
    assert dram.free_bytes == dram.capacity_bytes - 6 * CHUNK_COST


# ---- Fill: a payload encoded straight into its room (the connector's same-host saves) ----


class Fills:
    """``Fill`` records for ``chain(n, seed)``'s chunks: each encodes the same K/V as that
    chunk's payload; notes where each write went, and can make one of them fail."""

    def __init__(self, n: int, seed: int, fail_at: int | None = None) -> None:
        self.records = chain(n, seed=seed)
        self.outs: list[int] = []  # the address each write filled
        self.fail_at = fail_at
        self.fills = [
            shm_writer.Fill(r.key, r.parent, r.ns, len(r.payload), self._writer(i, seed))
            for i, r in enumerate(self.records)
        ]

    def _writer(self, i: int, seed: int):
        g = torch.Generator().manual_seed(seed * 1000 + i)  # as tests.chunks.payload does
        k, v = torch.randn(SHAPE, generator=g).half(), torch.randn(SHAPE, generator=g).half()

        def write(out: memoryview) -> None:
            if i == self.fail_at:
                raise ValueError(f"chunk {i} cannot be encoded")
            self.outs.append(np.frombuffer(out, np.uint8).ctypes.data)
            codec.encode(k, v, "raw", out=out)

        return write


def _in_region(client, addresses: list[int]) -> list[bool]:
    arr = client._shm_put_region[1].arr
    start = arr.ctypes.data
    return [start <= a < start + arr.nbytes for a in addresses]


def test_fills_write_their_payloads_in_their_rooms_and_read_back_as_encoded(client, served):
    f = Fills(4, seed=60)
    result = client.put(f.fills, shm=True)
    assert (result.stored, result.duplicates, result.rejected) == (4, 0, [])
    assert _in_region(client, f.outs) == [True] * 4  # written where it is kept: no copy
    assert [bytes(p) for p in client.get(keys_of(f.records))] == payloads_of(f.records)
    assert client.stats().tiers[1].chunks == 4  # written through, as any put
    again = client.put(f.fills, shm=True)  # held already: nothing is encoded
    assert (again.stored, again.duplicates, len(f.outs)) == (0, 4, 4)


def test_a_fill_given_no_room_is_encoded_into_its_own_buffer_and_sent_over_put(serve, open_store):
    served = serve(open_store(dram_slots=2))
    f = Fills(5, seed=61)
    with KVStoreClient(served.address) as c:
        result = c.put(f.fills, shm=True)
        assert (result.stored, result.rejected) == (5, [])
        assert sorted(_in_region(c, f.outs)) == [False] * 3 + [True] * 2
        assert [bytes(p) for p in c.get(keys_of(f.records))] == payloads_of(f.records)
        plain = Fills(2, seed=62)
        assert c.put(plain.fills).stored == 2  # without shm: into buffers, over Put
        assert [bytes(p) for p in c.get(keys_of(plain.records))] == payloads_of(plain.records)


def test_a_fill_that_fails_refuses_its_chain_from_there_and_holds_no_room(client, served):
    dram = served.store.tiers[0]
    f, other = Fills(4, seed=63, fail_at=2), Fills(2, seed=64)
    result = client.put(f.fills + other.fills, shm=True)  # two requests' chains, one save
    assert result.stored == 4  # the failing chunk's parents, and the other chain whole
    assert [k for k, _ in result.rejected] == keys_of(f.records)[2:]
    assert "chunk 2 cannot be encoded" in result.rejected[0][1]
    assert client.lookup(keys_of(f.records)).matched == 2
    assert [bytes(p) for p in client.get(keys_of(other.records))] == payloads_of(other.records)
    assert served.store._tickets == {}  # every room committed or given back
    assert dram.free_bytes == dram.capacity_bytes - 4 * CHUNK_COST
    plain = Fills(3, seed=65, fail_at=1)  # without shm: the same answer
    result = client.put(plain.fills)
    assert result.stored == 1 and [k for k, _ in result.rejected] == keys_of(plain.records)[1:]


def test_a_fill_that_ends_after_half_its_room_s_time_is_stored_once(serve, open_store):
    served = serve(open_store(), limits=Limits(default_lease_ttl_s=1.0))
    f = Fills(1, seed=66)
    write = f.fills[0].write

    def slow(out: memoryview) -> None:
        time.sleep(0.6)  # started in time, done past the first half of the room's second
        write(out)

    late = dataclasses.replace(f.fills[0], write=slow)
    with KVStoreClient(served.address) as c:
        result = c.put([late], shm=True)
        assert (result.stored, result.duplicates, result.rejected) == (1, 0, [])
        assert len(f.outs) == 1  # encoded once, in its room
        assert [bytes(p) for p in c.get(keys_of(f.records))] == payloads_of(f.records)


def test_a_store_without_shared_memory_gets_same_host_puts_over_put(serve, open_store):
    served = serve(open_store(), limits=Limits(shm=False))
    records, f = chain(2, seed=67), Fills(2, seed=68)
    with KVStoreClient(served.address) as c:
        assert c.put(records, shm=True).stored == 2
        assert c.put(f.fills, shm=True).stored == 2
        assert len(f.outs) == 2 and getattr(c, "_shm_put_region", None) is None  # no region
        for r in (records, f.records):
            assert [bytes(p) for p in c.get(keys_of(r))] == payloads_of(r)
