"""Bad input gets a status a person can act on, never UNKNOWN or INTERNAL, and the server
keeps serving: after every refusal a normal call still succeeds."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from kvstore.client import ClientError, KVStoreClient
from kvstore.core import wire
from kvstore.core.types import ChunkRecord
from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.service import Limits
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def refused(call, *args, **kwargs) -> ClientError:
    with pytest.raises(ClientError) as err:
        call(*args, **kwargs)
    assert err.value.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    return err.value


def still_serving(client: KVStoreClient, seed: int = 1000) -> None:
    records = chain(2, seed=seed)
    client.put(records)
    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)


def test_keys_of_the_wrong_length_name_their_index(client):
    good = keys_of(chain(2))
    for call in (client.lookup, client.get, client.explain, client.delete):
        err = refused(call, [good[0], b"short"])
        assert err.code == INVALID and "keys[1] is 5 bytes" in err.details, call
    err = refused(client.put, [ChunkRecord(b"k" * 15, None, b"n" * 32, b"payload")])
    assert err.code == INVALID and "keys[0] is 15 bytes" in err.details
    still_serving(client)


def test_too_many_keys(serve):
    served = serve(limits=Limits(max_keys_per_request=4))
    keys = keys_of(chain(5))
    with KVStoreClient(served.address) as c:
        for call in (c.lookup, c.get, c.explain, c.delete):
            err = refused(call, keys)
            assert err.code == INVALID and "5 keys" in err.details and "limit is 4" in err.details
        assert refused(c.put, chain(5, seed=1)).code == INVALID  # one message of five chunks
        assert c.lookup(keys[:4]).matched == 0
        still_serving(c)


def test_lease_ttl_negative_too_large_or_not_a_number(serve):
    served = serve(limits=Limits(max_lease_ttl_s=60))
    records = chain(2, seed=2)
    with KVStoreClient(served.address) as c:
        c.put(records)
        for ttl, words in ((-1.0, ">= 0"), (61.0, "max_lease_ttl_s=60"), (math.inf, "exceeds")):
            err = refused(c.lookup, keys_of(records), lease_ttl_s=ttl)
            assert err.code == INVALID and words in err.details
        # NaN passes "< 0" and "> max" alike; a NaN expiry would never end, and at the top of
        # the lease heap it would keep every later lease from expiring
        assert refused(c.lookup, keys_of(records), lease_ttl_s=math.nan).code == INVALID
        assert c.stats().active_leases == 0
        lease = c.lookup(keys_of(records), lease_ttl_s=60).lease_id
        assert lease
        c.release(lease)
        still_serving(c)


def test_an_expired_lease_is_not_held_back_by_a_nan_one(serve, raw_stub):
    served = serve()
    records = chain(2, seed=3)
    stub = raw_stub(served.address)
    with KVStoreClient(served.address) as c:
        c.put(records)
        with pytest.raises(grpc.RpcError) as err:
            stub.get_shm(pb.GetShmRequest(keys=keys_of(records), lease_ttl_s=math.nan))
        assert err.value.code() == INVALID
        short = c.lookup(keys_of(records), lease_ttl_s=0.01).lease_id
        assert short
        time.sleep(0.05)
        stats = c.stats()
        assert (stats.active_leases, stats.expired_leases) == (0, 1)


def test_a_chunk_over_max_chunk_bytes_is_resource_exhausted(serve):
    served = serve(limits=Limits(max_chunk_bytes=16 * 1024))
    with KVStoreClient(served.address) as c:
        err = refused(c.put, chain(2, seed=4))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_chunk_bytes is 16384" in err.details
        assert c.stats().chunks == 0
        assert c.stats().version  # still serving


def test_a_root_chunk_without_a_namespace_is_invalid(client):
    root = chain(1, seed=5)[0]
    for ns in (b"", b"x" * 31):
        err = refused(client.put, [ChunkRecord(root.key, None, ns, root.payload)])
        assert err.code == INVALID and "32-byte namespace" in err.details
    assert client.lookup([root.key]).matched == 0
    still_serving(client)


def test_a_bad_payload_is_rejected_in_the_response_not_the_status(client):
    records = chain(2, seed=6)
    garbage = ChunkRecord(records[0].key, None, records[0].ns, b"not a chunk payload at all")
    bad_magic = bytearray(records[0].payload)
    bad_magic[:4] = b"XXXX"
    result = client.put(
        [garbage, records[1], ChunkRecord(records[0].key, None, records[0].ns, bytes(bad_magic))]
    )
    assert result.stored == 0
    assert [reason for _, reason in result.rejected] == [
        "bad payload: payload is 26 bytes, shorter than the 36-byte header",
        "parent was rejected",
        "bad payload: bad magic b'XXXX', expected b'KVSC'",
    ]
    still_serving(client)


@pytest.mark.parametrize(
    "message",
    [
        b"\x0a\xff\xff",  # a length varint cut short
        b"\x0a\x05\x0a\x10",  # a chunk longer than the message
        b"\x0b",  # wire type 3 (start group)
        b"\x0a\x02\x09\x00",  # a fixed64 running past its chunk
    ],
)
def test_a_malformed_put_request_is_invalid_argument(served, raw_stub, message):
    stub = raw_stub(served.address)
    with pytest.raises(grpc.RpcError) as err:
        stub.put(iter([message]), timeout=5)
    assert err.value.code() == INVALID
    assert "malformed PutRequest" in err.value.details()
    with KVStoreClient(served.address) as c:
        still_serving(c)


def test_a_well_formed_message_after_a_good_batch_keeps_the_good_batch(served, raw_stub):
    records = chain(2, seed=7)
    stub = raw_stub(served.address)
    with pytest.raises(grpc.RpcError) as err:
        stub.put(iter([wire.encode_put_request(records), b"\x0a\xff\xff"]), timeout=5)
    assert err.value.code() == INVALID
    with KVStoreClient(served.address) as c:
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_release_of_an_unknown_lease_and_delete_of_an_unknown_namespace(client):
    err = refused(client.release, 987654)
    assert err.code == grpc.StatusCode.NOT_FOUND and "987654" in err.details
    err = refused(client.delete, namespace=b"\x42" * 32)
    assert err.code == grpc.StatusCode.NOT_FOUND and "42" * 32 in err.details
    err = refused(client.delete, namespace=b"\x42" * 5)
    assert err.code == INVALID
    still_serving(client)


def test_a_message_over_the_servers_limit_is_resource_exhausted(serve):
    served = serve(max_message_bytes=256 * 1024)
    root = chain(1, seed=8)[0]
    huge = ChunkRecord(root.key, None, root.ns, b"\x00" * (512 * 1024))
    with KVStoreClient(served.address) as c:
        err = refused(c.put, [huge])
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.stats().chunks == 0
        still_serving(c)


def test_an_unknown_method_is_unimplemented(served):
    with grpc.insecure_channel(served.address) as ch:
        call = ch.unary_unary(f"/{SERVICE}/Compact", None, None)
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
