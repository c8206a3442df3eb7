"""A Put cut short (client gone, deadline passed) leaves only whole chunks it sent."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.core import wire
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


class Stalled:
    """Request messages: the first batch, then nothing until ``resume`` is set, then the rest."""

    def __init__(self, batches: list[list]) -> None:
        self.batches = batches
        self.resume = threading.Event()
        self.sent = 0

    def __iter__(self):
        yield wire.encode_put_request(self.batches[0])
        self.sent = 1
        self.resume.wait(10)
        for batch in self.batches[1:]:
            yield wire.encode_put_request(batch)
            self.sent += 1


def assert_store_holds_exactly(served, records) -> None:
    """Everything the store holds is a whole chunk of ``records``, byte for byte."""
    by_key = {r.key: bytes(r.payload) for r in records}
    nodes = list(served.store.index.nodes())
    assert {n.key for n in nodes} <= set(by_key)
    for node in nodes:
        (got,) = served.store.get([n.key for n in reversed(_chain_to(node))])[-1:]
        assert bytes(got) == by_key[node.key]


def _chain_to(node):
    out = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out


@pytest.fixture
def put_call(served, raw_stub):
    return raw_stub(served.address).put


def test_a_client_that_disconnects_mid_put_leaves_no_partial_chunk(served, put_call, caplog):
    records = chain(9, seed=1)
    stream = Stalled([records[0:3], records[3:6], records[6:9]])

    future = put_call.future(iter(stream), timeout=10)
    wait_until(lambda: served.store.stats().put_chunks == 3)
    future.cancel()
    stream.resume.set()
    assert future.cancelled()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()

    # the handler notices the cancellation; give it a moment, then look at what is stored
    time.sleep(0.2)
    assert_store_holds_exactly(served, records)
    with KVStoreClient(served.address) as c:
        assert c.lookup(keys_of(records)).matched == 3
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records[:3])
        # the server still serves, and the rest can be put again
        assert c.put(records).stored == 6
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
    # a client going away is no server fault
    assert not [r for r in caplog.records if "internal error" in r.getMessage().lower()]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_put_cut_by_its_deadline_keeps_only_the_batches_that_arrived(served, put_call, caplog):
    records = chain(6, seed=2)
    stream = Stalled([records[0:2], records[2:4], records[4:6]])

    with pytest.raises(grpc.RpcError) as err:
        put_call(iter(stream), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream.resume.set()

    time.sleep(0.2)
    assert_store_holds_exactly(served, records)
    with KVStoreClient(served.address) as c:
        assert c.lookup(keys_of(records)).matched == 2
        assert c.stats().put_chunks == 2
        assert c.put(records).stored == 4
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
