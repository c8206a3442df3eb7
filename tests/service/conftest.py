"""A real kvstore server on an ephemeral loopback port, over real shared memory and LMDB.

Fixtures (``open_store`` comes from ``tests/conftest.py``): ``serve`` starts a
``StoreServer`` around a store and returns a ``Served`` with its address (every server
is stopped at teardown); ``served`` / ``client`` cover the common case. Helpers:
``keys_of`` and ``payloads_of`` (from ``tests.chunks``), ``raw_stub`` (hand-made stubs
over a plain channel, for what the typed client hides).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from kvstore.client import ClientOptions, KVStoreClient
from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.grpc_server import StoreServer
from kvstore.server.service import Limits
from kvstore.server.store import TieredStore
from tests.chunks import keys_of, payloads_of  # noqa: F401  (re-exported for the tests)


@dataclass
class Served:
    server: StoreServer
    store: TieredStore
    address: str

    @property
    def port(self) -> int:
        return self.server.port


@pytest.fixture
def serve(open_store):
    """``serve(store=None, limits=None, **server_kw) -> Served``; stopped at teardown."""
    running: list[StoreServer] = []

    def _serve(store: TieredStore | None = None, limits: Limits | None = None, **kw) -> Served:
        store = store if store is not None else open_store()
        kw.setdefault("grace_s", 2.0)
        kw.setdefault("workers", 8)
        server = StoreServer(store, "127.0.0.1:0", limits=limits, **kw)
        port = server.start()
        assert port > 0
        running.append(server)
        return Served(server, store, f"127.0.0.1:{port}")

    yield _serve
    for server in running:
        server.stop()


@pytest.fixture
def served(serve) -> Served:
    return serve()


@pytest.fixture
def client(served):
    """A client that keeps to gRPC: the same-host socket has its own tests (and the shm
    tests run over both), and a client made without options uses it."""
    with KVStoreClient(served.address, ClientOptions(timeout_s=10.0, local_calls=False)) as c:
        yield c


@dataclass
class RawStub:
    """Stubs over a plain channel: Get answers parsed ``Chunk`` messages, Put takes bytes."""

    channel: grpc.Channel

    def __post_init__(self) -> None:
        ch = self.channel
        m = f"/{SERVICE}/"
        self.get = ch.unary_stream(m + "Get", pb.GetRequest.SerializeToString, pb.Chunk.FromString)
        self.get_shm = ch.unary_unary(
            m + "GetShm", pb.GetShmRequest.SerializeToString, pb.ShmBatch.FromString
        )
        self.put = ch.stream_unary(m + "Put", None, pb.PutResponse.FromString)
        self.release = ch.unary_unary(
            m + "Release", pb.ReleaseRequest.SerializeToString, pb.ReleaseResponse.FromString
        )
        self.lookup = ch.unary_unary(
            m + "Lookup", pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
        )
        self.stats = ch.unary_unary(
            m + "Stats", pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString
        )


@pytest.fixture
def raw_stub():
    """``raw_stub(address) -> RawStub``; channels closed at teardown."""
    channels: list[grpc.Channel] = []

    def _stub(address: str) -> RawStub:
        ch = grpc.insecure_channel(address)
        channels.append(ch)
        return RawStub(ch)

    yield _stub
    for ch in channels:
        ch.close()
