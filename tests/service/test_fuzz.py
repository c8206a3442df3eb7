"""Generated hostile input against a live server: every RPC gets malformed and
adversarial messages (random bytes, truncated and garbled protobuf, wrong key lengths,
duplicate keys, broken chains, bad payload headers). The server never answers
INTERNAL or UNKNOWN for a client's mistake, never dies, and its state stays
consistent: what was stored before is still served byte for byte.

``KVSTORE_FUZZ_EXAMPLES`` sets the examples per strategy (default 1,500, so about
10,500 requests in all across the seven strategies).
"""

from __future__ import annotations

import os

import grpc
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvstore.client import KVStoreClient
from kvstore.core import wire
from kvstore.core.payload import HEADER_BYTES
from kvstore.core.types import ChunkRecord
from kvstore.rpc.pb import SERVICE, pb
from tests.chunks import chain, keys_of, payloads_of

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "1500"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
SERVER_FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
METHODS = ["Lookup", "Get", "GetShm", "Put", "Release", "Delete", "Stats", "Explain", "Routes"]
STREAM_OUT = {"Get"}
STREAM_IN = {"Put"}
KNOWN = chain(3, seed=77)  # stored before the fuzzing; must survive it
DECOY = chain(3, seed=78)  # never stored: garbled copies of real messages name these

keys16 = st.binary(min_size=16, max_size=16)
any_key = st.one_of(keys16, st.binary(max_size=40))
keys_lists = st.lists(st.one_of(any_key, st.sampled_from(keys_of(KNOWN))), max_size=40)


class Wire:
    """Raw byte-level calls, so the client library cannot tidy anything up."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        m = f"/{SERVICE}/"
        self.calls = {}
        for name in METHODS:
            if name in STREAM_OUT:
                self.calls[name] = self.channel.unary_stream(m + name)
            elif name in STREAM_IN:
                self.calls[name] = self.channel.stream_unary(m + name)
            else:
                self.calls[name] = self.channel.unary_unary(m + name)

    def status(self, method: str, *messages: bytes) -> grpc.StatusCode:
        call = self.calls[method]
        try:
            if method in STREAM_IN:
                call(iter(messages), timeout=10)
            elif method in STREAM_OUT:
                for _ in call(messages[0], timeout=10):
                    pass
            else:
                call(messages[0], timeout=10)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from kvstore.server.grpc_server import StoreServer
    from kvstore.server.store import TieredStore
    from kvstore.server.tiers.dram import DramTier
    from kvstore.server.tiers.nvme import NvmeTier

    path = tmp_path_factory.mktemp("fuzz")
    store = TieredStore([DramTier(32 << 20), NvmeTier(str(path / "lmdb"), 256 << 20)])
    server = StoreServer(store, "127.0.0.1:0", workers=8, grace_s=1.0)
    address = f"127.0.0.1:{server.start()}"
    with KVStoreClient(address) as client:
        assert client.put(KNOWN).stored == 3
    raw = Wire(address)
    yield address, raw, store
    raw.channel.close()
    server.stop()
    store.close()


def check(raw: Wire, method: str, *messages: bytes) -> None:
    code = raw.status(method, *messages)
    assert code not in SERVER_FAULTS, (method, code, messages[:1])


@FUZZ
@given(method=st.sampled_from(METHODS), data=st.binary(max_size=300))
def test_random_bytes_on_every_rpc(live, method, data):
    check(live[1], method, data)


@FUZZ
@given(method=st.sampled_from(METHODS), cut=st.integers(0, 200), flip=st.integers(0, 255))
def test_truncated_and_garbled_protobuf(live, method, cut, flip):
    # a valid Delete naming stored keys would rightly delete them: garble decoys instead
    msg = pb.LookupRequest(keys=keys_of(DECOY), lease_ttl_s=5).SerializeToString()
    if method == "Put":
        msg = wire.encode_put_request(DECOY[:1])
    body = bytearray(msg[: max(1, min(cut, len(msg)))])
    body[flip % len(body)] ^= 0xFF
    check(live[1], method, bytes(body))


@FUZZ
@given(keys=keys_lists, ttl=st.floats(allow_nan=True, allow_infinity=True))
def test_lookup_get_and_explain_with_adversarial_keys(live, keys, ttl):
    raw = live[1]
    check(raw, "Lookup", pb.LookupRequest(keys=keys, lease_ttl_s=ttl).SerializeToString())
    check(raw, "Get", pb.GetRequest(keys=keys).SerializeToString())
    check(raw, "GetShm", pb.GetShmRequest(keys=keys, lease_ttl_s=ttl).SerializeToString())
    check(raw, "Explain", pb.ExplainRequest(keys=keys).SerializeToString())


@FUZZ
@given(
    lease=st.integers(0, 2**64 - 1),
    keys=st.lists(any_key, max_size=8),
    ns=st.binary(max_size=40),
)
def test_release_and_delete_of_anything(live, lease, keys, ns):
    raw = live[1]
    check(raw, "Release", pb.ReleaseRequest(lease_id=lease).SerializeToString())
    check(raw, "Delete", pb.DeleteRequest(keys=keys, namespace=ns).SerializeToString())


chunk = st.builds(
    pb.PutChunk,
    key=any_key,
    parent=st.one_of(st.just(b""), any_key, st.sampled_from(keys_of(KNOWN))),
    namespace=st.binary(max_size=40),
    payload=st.one_of(
        st.binary(max_size=200),
        st.sampled_from(payloads_of(KNOWN)).map(bytes),
    ),
)


@FUZZ
@given(chunks=st.lists(chunk, max_size=6), extra=st.lists(st.binary(max_size=64), max_size=2))
def test_puts_with_broken_chains_duplicate_keys_and_bad_payloads(live, chunks, extra):
    msg = pb.PutRequest(chunks=chunks).SerializeToString()
    check(live[1], "Put", msg, *extra)


@FUZZ
@given(
    pos=st.integers(0, HEADER_BYTES + 64),
    value=st.integers(0, 255),
    tail=st.integers(-64, 64),
)
def test_payload_headers_truncated_oversized_or_garbled(live, pos, value, tail):
    src = KNOWN[0]
    payload = bytearray(src.payload)
    payload[pos % len(payload)] = value
    payload = payload[: len(payload) + tail] if tail < 0 else payload + bytes(tail)
    key = bytes([pos % 256, value, tail % 256]) + b"\x00" * 13
    rec = ChunkRecord(key, None, src.ns, bytes(payload))
    check(live[1], "Put", wire.encode_put_request([rec]))


@FUZZ
@given(method=st.sampled_from(["Lookup", "GetShm", "Explain"]), n=st.integers(0, 3))
def test_duplicate_keys(live, method, n):
    keys = keys_of(KNOWN)[:n] * 3
    cls = {"Lookup": pb.LookupRequest, "GetShm": pb.GetShmRequest, "Explain": pb.ExplainRequest}
    check(live[1], method, cls[method](keys=keys).SerializeToString())


def test_state_is_consistent_after_the_fuzzing(live):
    address, _, store = live
    with KVStoreClient(address) as client:
        assert [bytes(p) for p in client.get(keys_of(KNOWN))] == payloads_of(KNOWN)
        stats = client.stats()
    assert stats.tiers[0].corrupt == 0 and stats.tiers[1].corrupt == 0
    # every chunk the index knows is readable, and no lease outlives its call
    assert stats.chunks == len(store.index)
    for node in list(store.index.nodes()):
        assert store.tiers[store.index.top_tier(node)].read([node.key])[0] is not None
