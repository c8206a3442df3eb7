"""Puts go where the store says (``Routes``): to its put process when it has one; to the
store itself when it has none, when the put process is down or gone, when the store is
older than ``Routes``, on a Unix socket, or when the client is told not to route. A put
the put process refuses, or that runs out of time there, is raised, not resent.

A second ``StoreServer`` over the same store stands in for the put process; each server's
own metrics (``kvstore_rpc_total``) say which one a call reached.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest

from kvstore.client import ClientError, ClientOptions, KVStoreClient, put_routes
from kvstore.client.put_routes import put_target
from kvstore.rpc.pb import SERVICE, pb
from kvstore.rpc.tls import ClientAuth, server_credentials
from kvstore.server.auth import Tenants
from kvstore.server.grpc_server import StoreServer
from kvstore.server.metrics import Metrics
from kvstore.server.service import KVStoreService, Limits
from kvstore.server.service_handlers import generic_handler
from tests.certs import make_pki
from tests.chunks import chain
from tests.service.conftest import Served, keys_of, payloads_of
from tests.service.test_security import TOKENS

# how long the tests let a client's answer from Routes stand (the client's is 10 s); the
# steps a test expects within it take milliseconds
REASK_S = 0.5


class Borrowed:
    """The store, lent to a second server: stopping that server must not close it."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def close(self) -> None:
        pass


@dataclass
class Metered:
    served: Served
    metrics: Metrics

    def calls(self, method: str, code: str | None = "OK") -> int:
        """Calls of ``method`` this server finished with ``code`` (None: any code)."""
        codes = [code] if code else [c.name for c in grpc.StatusCode]
        get = self.metrics.registry.get_sample_value
        return int(sum(get("kvstore_rpc_total", {"method": method, "code": c}) or 0 for c in codes))

    @property
    def service(self) -> KVStoreService:
        return self.served.server.service


@pytest.fixture
def store(serve, open_store) -> Metered:
    """A store's own server."""
    s = open_store()
    metrics = Metrics(s.stats)
    return Metered(serve(s, metrics=metrics), metrics)


@pytest.fixture
def put_process(serve, store):
    """``put_process(**server_kw) -> Metered``: a second server over ``store``'s store, which
    ``store`` then advertises as its put process."""

    def start(**kw) -> Metered:
        metrics = Metrics(store.served.store.stats)
        b = Metered(serve(Borrowed(store.served.store), metrics=metrics, **kw), metrics)
        store.service.put_port = b.served.port
        return b

    return start


@pytest.fixture
def client(store):
    with KVStoreClient(store.served.address, ClientOptions(timeout_s=10.0)) as c:
        yield c


@pytest.fixture
def bare_server():
    """``bare_server(*handlers) -> port``: a gRPC server with only these generic handlers."""
    servers: list[grpc.Server] = []

    def start(*handlers) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return port

    yield start
    for server in servers:
        server.stop(0).wait()


def read_back(served: Served, records) -> list[bytes]:
    with KVStoreClient(served.address, ClientOptions(route_puts=False)) as c:
        return [bytes(p) for p in c.get(keys_of(records))]


def test_routes_answers_the_put_port_and_0_without_one(store):
    with grpc.insecure_channel(store.served.address) as ch:
        routes = ch.unary_unary(
            f"/{SERVICE}/Routes", pb.RoutesRequest.SerializeToString, pb.RoutesResponse.FromString
        )
        assert routes(pb.RoutesRequest(), timeout=5).put_port == 0
        store.service.put_port = 4321
        assert routes(pb.RoutesRequest(), timeout=5).put_port == 4321
        store.service.put_port = None
        assert routes(pb.RoutesRequest(), timeout=5).put_port == 0
    assert store.calls("Routes") == 3


def test_puts_go_to_the_put_process_and_read_back_from_the_store(store, put_process, client):
    b = put_process()
    first, second = chain(4, seed=1), chain(3, seed=2)
    assert client.put(first).stored == 4
    assert client.put(second).stored == 3
    assert (b.calls("Put"), store.calls("Put", None)) == (2, 0)
    assert (store.calls("Routes"), b.calls("Routes", None)) == (1, 0)  # asked once, of the store
    assert read_back(store.served, first) == payloads_of(first)
    assert read_back(store.served, second) == payloads_of(second)


def test_with_no_put_process_puts_go_to_the_store_which_is_not_asked_every_time(store, client):
    for seed in range(3):
        assert client.put(chain(2, seed=seed)).stored == 2
    assert (store.calls("Put"), store.calls("Routes")) == (3, 1)


@pytest.mark.parametrize("how", ["stopped", "draining"])
def test_a_put_process_that_is_down_sends_puts_back_to_the_store(
    store, put_process, client, monkeypatch, how
):
    monkeypatch.setattr(put_routes, "REASK_S", REASK_S)
    b = put_process()
    assert client.put(chain(3, seed=1)).stored == 3
    assert (b.calls("Put"), store.calls("Put")) == (1, 0)
    time.sleep(REASK_S + 0.05)  # the answer is due again: only the failure below holds it off
    if how == "stopped":
        b.served.server.stop()
    else:
        b.service.drain()  # answers UNAVAILABLE, "shutting down"

    records = chain(3, seed=2)
    assert client.put(records).stored == 3  # resent to the store's own Put
    assert read_back(store.served, records) == payloads_of(records)
    refused = b.calls("Put", "UNAVAILABLE")  # a draining one counts what it turned away
    assert refused >= (how == "draining")
    assert client.put(chain(3, seed=3)).stored == 3  # the route is forgotten: straight there
    assert (b.calls("Put"), store.calls("Put"), store.calls("Routes")) == (1, 2, 1)
    assert b.calls("Put", "UNAVAILABLE") == refused

    store.service.put_port = None  # the store knows it has no put process now
    time.sleep(REASK_S + 0.05)
    assert client.put(chain(3, seed=4)).stored == 3
    assert (b.calls("Put"), store.calls("Put"), store.calls("Routes")) == (1, 3, 2)


def test_a_put_process_that_comes_up_later_is_used_once_the_store_is_asked_again(
    store, put_process, client, monkeypatch
):
    monkeypatch.setattr(put_routes, "REASK_S", REASK_S)
    assert client.put(chain(2, seed=1)).stored == 2
    b = put_process()
    assert client.put(chain(2, seed=2)).stored == 2  # not asked again yet
    assert (store.calls("Put"), b.calls("Put"), store.calls("Routes")) == (2, 0, 1)
    time.sleep(REASK_S + 0.05)
    records = chain(2, seed=3)
    assert client.put(records).stored == 2
    assert (store.calls("Put"), b.calls("Put"), store.calls("Routes")) == (2, 1, 2)
    assert read_back(store.served, records) == payloads_of(records)


def test_a_put_port_that_serves_no_put_sends_puts_to_the_store(store, client, bare_server):
    store.service.put_port = bare_server()  # every call there is UNIMPLEMENTED
    records = chain(3, seed=5)
    assert client.put(records).stored == 3
    assert store.calls("Put") == 1
    assert read_back(store.served, records) == payloads_of(records)


class _Without(grpc.GenericRpcHandler):
    """``handler`` less ``method``, and how many calls asked for it: an older store."""

    def __init__(self, handler: grpc.GenericRpcHandler, method: str) -> None:
        self.handler, self.method, self.asked = handler, f"/{SERVICE}/{method}", 0

    def service(self, handler_call_details):
        if handler_call_details.method == self.method:
            self.asked += 1
            return None
        return self.handler.service(handler_call_details)


def test_a_put_port_that_never_answers_costs_a_short_put_only_a_moment(store):
    """A put port whose connection never comes up (a firewall that drops, a port forward of
    the store's port only) must not hold a put until its deadline: a put with less time
    than gRPC's connect timeout once failed DEADLINE_EXCEEDED there and went nowhere."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, then never speaks HTTP/2
    try:
        store.service.put_port = silent.getsockname()[1]
        records = chain(3, seed=7)
        with KVStoreClient(store.served.address, ClientOptions(timeout_s=1.5)) as client:
            t0 = time.monotonic()
            assert client.put(records).stored == 3
            waited = time.monotonic() - t0
        assert store.calls("Put") == 1 and waited < 1.5  # the store got it, in time
        assert read_back(store.served, records) == payloads_of(records)
    finally:
        silent.close()


def test_a_store_older_than_routes_gets_the_puts_and_is_asked_seldom(open_store, bare_server):
    s = open_store()
    old = _Without(generic_handler(KVStoreService(s, Limits())), "Routes")
    port = bare_server(old)
    with KVStoreClient(f"127.0.0.1:{port}", ClientOptions(timeout_s=10.0)) as c:
        for seed in range(3):
            records = chain(2, seed=seed)
            assert c.put(records).stored == 2
            assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
    assert old.asked == 1


def test_a_client_told_not_to_route_never_uses_the_put_process(store, put_process):
    b = put_process()
    with KVStoreClient(store.served.address, ClientOptions(route_puts=False)) as c:
        assert c.put(chain(3, seed=1)).stored == 3
    assert (store.calls("Put"), b.calls("Put", None), store.calls("Routes", None)) == (1, 0, 0)


def test_a_unix_socket_client_never_routes(store, put_process):
    b = put_process()
    metrics = Metrics(store.served.store.stats)
    with tempfile.TemporaryDirectory(prefix="kvs") as d:
        local = StoreServer(
            Borrowed(store.served.store), f"unix:{d}/s.sock", metrics=metrics, grace_s=1.0
        )
        local.start()
        local.service.put_port = b.served.port
        try:
            with KVStoreClient(f"unix:{d}/s.sock", ClientOptions(timeout_s=10.0)) as c:
                assert c.put(chain(3, seed=1)).stored == 3
        finally:
            local.stop()
    unix = Metered(Served(local, store.served.store, ""), metrics)
    assert (unix.calls("Put"), unix.calls("Routes", None), b.calls("Put", None)) == (1, 0, 0)


def test_a_refusal_from_the_put_process_is_raised_not_resent(store, put_process, client):
    b = put_process(limits=Limits(max_chunk_bytes=1000))
    records = chain(2, seed=1)
    with pytest.raises(ClientError) as err:
        client.put(records)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_chunk_bytes" in err.value.details
    assert (b.calls("Put", "RESOURCE_EXHAUSTED"), store.calls("Put", None)) == (1, 0)
    assert client.lookup(keys_of(records)).matched == 0


def test_a_put_that_runs_out_of_time_at_the_put_process_is_not_resent(store, client, bare_server):
    release = threading.Event()

    def stall(requests, context):
        for _ in requests:
            pass
        release.wait(10)
        return pb.PutResponse()

    put = grpc.stream_unary_rpc_method_handler(
        stall, response_serializer=pb.PutResponse.SerializeToString
    )
    store.service.put_port = bare_server(
        grpc.method_handlers_generic_handler(SERVICE, {"Put": put})
    )
    try:
        with pytest.raises(ClientError) as err:
            client.put(chain(2, seed=1), timeout_s=0.5)
    finally:
        release.set()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert store.calls("Put", None) == 0


def test_puts_from_many_threads_share_one_question_and_all_land(store, put_process, client):
    b = put_process()
    chains = [chain(2, seed=100 + i) for i in range(8)]
    with futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client.put, chains))
    assert [r.stored for r in results] == [2] * 8
    assert store.calls("Routes") == 1
    # puts made while the first one asked went to the store; the rest to the put process
    assert store.calls("Put") + b.calls("Put") == 8 and b.calls("Put") >= 1
    for records in chains:
        assert read_back(store.served, records) == payloads_of(records)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_the_put_port_is_reached_with_the_client_s_tls_and_token(serve, open_store, pki, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: team-a\n    tokens: [{TOKENS['team-a']}]\n")
    s = open_store()
    am, bm = Metrics(s.stats), Metrics(s.stats)

    def secured(store, metrics) -> Metered:
        creds = server_credentials(pki.server_cert, pki.server_key)
        served = serve(
            store, credentials=creds, tenants=Tenants.load(str(tenants)), metrics=metrics
        )
        return Metered(served, metrics)

    a, b = secured(s, am), secured(Borrowed(s), bm)
    a.service.put_port = b.served.port
    auth = ClientAuth(ca=pki.ca, token=TOKENS["team-a"])
    records = chain(3, seed=1)
    with KVStoreClient(f"localhost:{a.served.port}", ClientOptions(auth=auth, retries=0)) as c:
        assert c.put(records).stored == 3
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
    assert (b.calls("Put"), a.calls("Put", None)) == (1, 0)


@pytest.mark.parametrize(
    "target, routed",
    [
        ("127.0.0.1:50051", "127.0.0.1:7"),
        ("localhost:50051", "localhost:7"),
        ("[::1]:50051", "[::1]:7"),
        ("ipv4:10.0.0.1:50051", "ipv4:10.0.0.1:7"),
        ("dns:///store.example:50051", "dns:///store.example:7"),
        ("localhost", "localhost:7"),
        ("unix:/tmp/kvstore.sock", None),
        ("unix-abstract:kvstore", None),
        ("ipv4:10.0.0.1:50051,10.0.0.2:50051", None),
    ],
)
def test_the_put_port_is_on_the_store_s_host(target, routed):
    assert put_target(target, 7) == routed
