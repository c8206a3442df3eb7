"""How gRPC reaches the servicer: method handlers and the request parsers behind them.

Offers ``generic_handler(service)`` (every ``kvstore.v1.KVStore`` method, with the
hand-coded framing of ``kvstore.core.wire`` for ``Get`` and ``Put`` payloads),
``Malformed``, what a parser hands the handler instead of a request that did not parse,
and ``request_parser``/``checked``, the pair that makes it so (the store's same-host
socket uses them too).
A parser never raises: gRPC would answer ``INTERNAL`` and blame the server for the
client's bytes; the handler refuses the call with ``INVALID_ARGUMENT`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from kvstore.core import wire
from kvstore.core.types import InvalidArgument
from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.service_calls import Abort, ServiceCalls

if TYPE_CHECKING:
    from kvstore.server.service import KVStoreService


def generic_handler(
    service: KVStoreService, only: tuple[str, ...] | None = None
) -> grpc.GenericRpcHandler:
    """Method handlers for ``kvstore.v1.KVStore``; Get and Put bypass protobuf for payloads.
    With ``only``, just those methods (the put process serves ``Put`` alone)."""

    def unary(fn, req):
        return grpc.unary_unary_rpc_method_handler(
            checked(service, fn),
            request_deserializer=request_parser(req),
            response_serializer=_serialize,
        )

    handlers = {
        "Lookup": unary(service.Lookup, pb.LookupRequest),
        "Get": grpc.unary_stream_rpc_method_handler(
            checked(service, service.Get), request_deserializer=request_parser(pb.GetRequest)
        ),
        "Put": grpc.stream_unary_rpc_method_handler(
            service.Put,
            request_deserializer=_parse_put,
            response_serializer=_serialize,
        ),
        "GetShm": unary(service.GetShm, pb.GetShmRequest),
        "ReserveShm": unary(service.ReserveShm, pb.ReserveShmRequest),
        "CommitShm": unary(service.CommitShm, pb.CommitShmRequest),
        "Release": unary(service.Release, pb.ReleaseRequest),
        "Delete": unary(service.Delete, pb.DeleteRequest),
        "Stats": unary(service.Stats, pb.StatsRequest),
        "Explain": unary(service.Explain, pb.ExplainRequest),
        "Routes": unary(service.Routes, pb.RoutesRequest),
    }
    if only is not None:
        handlers = {name: h for name, h in handlers.items() if name in only}
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _serialize(message) -> bytes:
    return message.SerializeToString()


class Malformed:
    """A request that did not parse; raising here would reach the client as INTERNAL."""

    def __init__(self, error: str) -> None:
        self.error = error


def request_parser(cls) -> Callable[[bytes], object]:
    """``cls.FromString`` that hands a parse failure to the handler instead of raising.

    A deserializer that raises makes gRPC answer INTERNAL ("Exception deserializing
    request!"), blaming the server for the client's bytes.
    """

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError and whatever else bad bytes provoke
            return Malformed(f"malformed {cls.DESCRIPTOR.name}: {exc}")

    return parse


def checked(service: ServiceCalls, fn):
    """``fn`` for well-formed requests; INVALID_ARGUMENT (counted) for malformed ones."""
    method = fn.__name__

    def handler(request, context):
        if isinstance(request, Malformed):
            return service._call(method, context, lambda caller: _refuse(request))
        return fn(request, context)

    return handler


def _refuse(request: Malformed):
    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, request.error, "malformed_request")


def _parse_put(data: bytes) -> wire.PutMessage | Malformed:
    try:
        return wire.parse_put_message(data)
    except InvalidArgument as exc:
        return Malformed(str(exc))
