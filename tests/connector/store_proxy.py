"""A gRPC pass-through in front of a real store, to kill that store at an exact moment.

``StoreProxy(upstream)`` listens on a loopback port and forwards every kvstore call
(bytes in, bytes out; no parsing) to ``upstream``. ``kill_on_next_load(fn)`` makes
the next ``Get`` or ``GetShm`` run ``fn`` (which kills the store) before it is
forwarded: the connector's lookup has succeeded, its load then meets a dead store.
While a kill is armed, Lookups go upstream without asking for shared-memory handles
(the one message parsed here): given them, a same-host load calls no store at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from kvstore.rpc.pb import SERVICE, pb

_OPTIONS = [
    ("grpc.max_send_message_length", 65 << 20),
    ("grpc.max_receive_message_length", 65 << 20),
]
_STREAM_OUT = {"Get"}
_STREAM_IN = {"Put"}
_LOADS = {"Get", "GetShm"}


class StoreProxy(grpc.GenericRpcHandler):
    def __init__(self, upstream: str) -> None:
        self._channel = grpc.insecure_channel(upstream, options=_OPTIONS)
        self._lock = threading.Lock()
        self._on_load: Callable[[], None] | None = None
        self.loads_killed = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
        self._server.add_generic_rpc_handlers((self,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.address = f"127.0.0.1:{port}"

    def kill_on_next_load(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._on_load = fn

    def _before(self, name: str) -> None:
        if name not in _LOADS:
            return
        with self._lock:
            fn, self._on_load = self._on_load, None
        if fn is not None:
            fn()
            self.loads_killed += 1

    def service(self, details):
        method = details.method
        if not method.startswith(f"/{SERVICE}/") and not method.startswith("/grpc.health"):
            return None
        name = method.rsplit("/", 1)[1]

        def relay_error(exc: grpc.RpcError, context) -> None:
            context.abort(exc.code(), exc.details() or "")

        if name in _STREAM_OUT:
            call = self._channel.unary_stream(method)

            def unary_stream(request, context):
                self._before(name)
                try:
                    yield from call(request, timeout=context.time_remaining())
                except grpc.RpcError as exc:
                    relay_error(exc, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if name in _STREAM_IN:
            call = self._channel.stream_unary(method)

            def stream_unary(requests, context):
                try:
                    return call(requests, timeout=context.time_remaining())
                except grpc.RpcError as exc:
                    relay_error(exc, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        call = self._channel.unary_unary(method)

        def unary_unary(request, context):
            self._before(name)
            if name == "Lookup" and self._on_load is not None:
                lookup = pb.LookupRequest.FromString(request)
                lookup.shm = False
                request = lookup.SerializeToString()
            try:
                return call(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:
                relay_error(exc, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary)

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()
