"""Graceful shutdown: in-flight calls finish, new ones are refused as UNAVAILABLE, and the
store is flushed and closed."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.rpc.pb import pb
from kvstore.server.grpc_server import StoreServer
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of
from tests.service.test_disconnect import Stalled, wait_until


def stop_in_background(served) -> threading.Thread:
    stopper = threading.Thread(target=served.server.stop)
    stopper.start()
    wait_until(served.server.service._draining.is_set)
    return stopper


def refused_while_stopping(address: str) -> None:
    late = KVStoreClient(address, ClientOptions(timeout_s=2, retries=0))
    with late, pytest.raises(ClientError) as err:
        late.stats()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_put_stream_in_flight_completes_while_new_calls_are_refused(
    serve, open_store, tmp_path, raw_stub
):
    served = serve(open_store(path=tmp_path / "db"), grace_s=5)
    records = chain(6, seed=1)
    stream = Stalled([records[:3], records[3:]])
    future = raw_stub(served.address).put.future(iter(stream), timeout=10)
    wait_until(lambda: served.store.stats().put_chunks == 3)

    stopper = stop_in_background(served)
    refused_while_stopping(served.address)
    stream.resume.set()

    result = future.result(timeout=5)
    assert (result.stored, result.duplicates, list(result.rejected)) == (6, 0, [])
    stopper.join(10)
    assert not stopper.is_alive()

    again = serve(open_store(path=tmp_path / "db"))
    with KVStoreClient(again.address) as c:
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_a_get_stream_in_flight_is_read_to_the_end_during_shutdown(served, raw_stub):
    records = chain(40, seed=2)  # about 1.3 MB: more than the stream's flow-control window
    with KVStoreClient(served.address) as c:
        c.put(records)
    responses = raw_stub(served.address).get(pb.GetRequest(keys=keys_of(records)), timeout=10)
    first = next(responses)

    stopper = stop_in_background(served)
    refused_while_stopping(served.address)

    rest = list(responses)
    assert [first.payload] + [m.payload for m in rest] == payloads_of(records)
    stopper.join(10)
    assert not stopper.is_alive()


def test_write_back_chunks_are_flushed_to_lmdb_at_stop(serve, open_store, tmp_path):
    served = serve(open_store(path=tmp_path / "db", policy="write_back"))
    records = chain(5, seed=3)
    with KVStoreClient(served.address) as c:
        c.put(records)
        stats = c.stats()
    assert stats.write_policy == "write_back" and stats.tiers[1].chunks == 0

    served.server.stop()
    assert served.server.wait(0)

    again = serve(open_store(path=tmp_path / "db", policy="write_back"))
    with KVStoreClient(again.address) as c:
        assert c.lookup(keys_of(records)).tiers == ["nvme"] * 5
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_stop_is_idempotent_and_a_second_server_can_take_the_port(serve, open_store):
    served = serve()
    served.server.stop()
    served.server.stop()
    port = served.port
    second = StoreServer(open_store(dram_slots=4, nvme_bytes=0), f"127.0.0.1:{port}")
    try:
        assert second.start() == port
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.ping()
    finally:
        second.stop()
