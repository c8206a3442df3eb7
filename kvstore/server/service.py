"""The gRPC servicer: translates protobuf to store calls and store errors to status codes.

Offers ``KVStoreService`` (the method implementations) and ``generic_handler``
(registers them with the hand-coded serializers for ``Get`` and ``Put``).
Logic lives in ``TieredStore``; this module only validates request limits,
maps errors and records metrics. It never answers a malformed request with
``INTERNAL``: the status names the field (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from kvstore.core import wire
from kvstore.core.types import (
    ChunkRecord,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PayloadError,
    TierFullError,
)
from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.auth import (
    Caller,
    Tenants,
    Unauthenticated,
    owns,
    shown_namespace,
    tag_namespace,
)
from kvstore.server.explain import explain
from kvstore.server.quotas import QuotaExceeded, Quotas
from kvstore.server.reads import ShmRef
from kvstore.server.store import TieredStore

log = logging.getLogger(__name__)

_CODES = [
    (PayloadError, grpc.StatusCode.INVALID_ARGUMENT, "bad_payload"),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (NotFound, grpc.StatusCode.NOT_FOUND, "not_found"),
    (TierFullError, grpc.StatusCode.RESOURCE_EXHAUSTED, "tiers_full"),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"),
    (KVStoreError, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"),
]


@dataclass(frozen=True, slots=True)
class Limits:
    max_keys_per_request: int = 65536
    max_chunk_bytes: int = 64 << 20
    default_lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    shm: bool = True
    max_leases_per_client: int = 4096
    max_streams_per_client: int = 64
    max_inflight_bytes_per_client: int = 1 << 30


def _status_of(exc: KVStoreError) -> tuple[grpc.StatusCode, str]:
    for cls, code, reason in _CODES:
        if isinstance(exc, cls):
            return code, reason
    return grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class KVStoreService:
    def __init__(
        self, store: TieredStore, limits: Limits, metrics=None, tenants: Tenants | None = None
    ) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.tenants = tenants
        self.quotas = Quotas(
            limits.max_leases_per_client,
            limits.max_streams_per_client,
            limits.max_inflight_bytes_per_client,
        )
        self.started = time.monotonic()
        self._draining = threading.Event()

    def drain(self) -> None:
        """Refuse new calls with UNAVAILABLE while in-flight ones finish."""
        self._draining.set()

    # ---- helpers ---------------------------------------------------------------------

    def _keys(self, keys) -> list[bytes]:
        if len(keys) > self.limits.max_keys_per_request:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys in one request; the limit is {self.limits.max_keys_per_request}",
                "too_many_keys",
            )
        keys = list(keys)
        # one pass at C speed for the common case (512-key lookups); find the culprit after
        if any(n != 16 for n in map(len, keys)):
            i, key = next((i, k) for i, k in enumerate(keys) if len(k) != 16)
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"keys[{i}] is {len(key)} bytes; chunk keys are 16 bytes (xxh3-128)",
                "invalid_argument",
            )
        return keys

    def _reserve_ttl(self, request) -> float:
        ttl = request.reserve_ttl_s
        if not (0 < ttl <= self.limits.max_lease_ttl_s):  # also refuses NaN
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reserve_ttl_s must be in (0, {self.limits.max_lease_ttl_s}], got {ttl}",
                "bad_ttl",
            )
        if len(request.holder) > 256:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "holder must be at most 256 bytes",
                "invalid_argument",
            )
        return ttl

    def _ttl(self, ttl: float) -> float | None:
        # NaN passes both range checks below; a NaN expiry never comes, and at the top of
        # the lease heap it would keep every later lease from expiring too
        if math.isnan(ttl) or ttl < 0:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"lease_ttl_s must be >= 0, got {ttl}", "bad_ttl"
            )
        if ttl > self.limits.max_lease_ttl_s:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ttl_s={ttl} exceeds the server's max_lease_ttl_s="
                f"{self.limits.max_lease_ttl_s}",
                "bad_ttl",
            )
        return ttl or None

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        if self.tenants is None:
            return Caller(client=f"peer:{_host_of(context.peer())}")
        return self.tenants.authenticate(context.invocation_metadata())

    def _call(
        self,
        method: str,
        context: grpc.ServicerContext,
        fn: Callable[[Caller], object],
        *,
        stream: bool = False,
    ):
        """Run ``fn(caller)`` with draining, authentication, error mapping and metrics.

        With ``stream``, ``fn`` returns the response messages, and the call is timed
        until the last of them is sent (or the client goes away), not until ``fn``
        returns.
        """
        t0: float | None = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if self._draining.is_set():
                raise _Abort(
                    grpc.StatusCode.UNAVAILABLE, "server is shutting down", "shutting_down"
                )
            result = fn(self._caller(context))
            if stream:
                result, t0 = self._streamed(method, t0, result), None
            return result
        except QuotaExceeded as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self._reject(exc.reason)
            context.abort(code, str(exc))
        except _Abort as exc:
            code = exc.code
            self._reject(exc.reason)
            context.abort(exc.code, str(exc))
        except KVStoreError as exc:
            code, reason = _status_of(exc)
            self._reject(reason)
            context.abort(code, str(exc))
        except grpc.RpcError:
            # gRPC's own signal that the client cancelled or its deadline passed mid-stream;
            # re-raised, gRPC ends the call quietly: no server fault, nothing to log
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", method)
            context.abort(code, f"internal error in {method}; see the server log")
        finally:
            if self.metrics is not None and t0 is not None:
                self.metrics.observe_rpc(method, time.perf_counter() - t0, code.name)

    def _streamed(self, method: str, t0: float, messages: Iterator[bytes]) -> Iterator[bytes]:
        """``messages``, counted on the wire; the call's time and code are recorded at its end."""
        code = grpc.StatusCode.OK
        try:
            for message in messages:
                self._wire("out", len(message))
                yield message
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED  # gRPC dropped the stream: the client went away
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN  # what gRPC answers for a failing response stream
            log.exception("%s failed while streaming", method)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_rpc(method, time.perf_counter() - t0, code.name)

    def _reject(self, reason: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason, n)

    def _wire(self, direction: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.bytes_transferred(direction, n)

    # ---- RPCs ------------------------------------------------------------------------

    def Lookup(self, request, context):
        def run(caller: Caller):
            ttl = self._ttl(request.lease_ttl_s)
            if ttl:
                self.quotas.check_leases(caller.client)
            reserve = None
            if request.reserve_ttl_s:
                reserve = (request.holder or caller.client, self._reserve_ttl(request))
            res = self.store.lookup(self._keys(request.keys), ttl, caller.tag, reserve)
            if res.lease_id:
                self.quotas.lease_taken(caller.client, res.lease_id, ttl)
            return pb.LookupResponse(
                matched=res.matched,
                tiers=res.tiers,
                lease_id=res.lease_id or 0,
                pending=res.pending,
                reserved=res.reserved,
            )

        return self._call("Lookup", context, run)

    def Get(self, request, context) -> Iterator[bytes]:
        # A stream cannot abort once it started, so validate, and read or lease the
        # chunks, first; the call is timed until its last message is sent.
        def run(caller: Caller):
            keys = self._keys(request.keys)
            stream = self.quotas.stream(caller.client)
            stream.__enter__()
            try:
                # a lease as long as the call may last keeps the slots read below from reuse
                ttl = min(self.limits.max_lease_ttl_s, context.time_remaining() + 1.0)
                lease_id, payloads = self.store.get_shm(keys, ttl, views=True, owner=caller.tag)
            except BaseException:
                stream.__exit__(None, None, None)
                raise
            return self._encode(keys, payloads, lease_id, stream)

        return self._call("Get", context, run, stream=True)

    def GetShm(self, request, context):
        """All handles in one message: a streamed message each costs more than its copy."""

        def run(caller: Caller):
            self._shm_allowed(context, instead="Get")
            keys = self._keys(request.keys)
            ttl = self._ttl(request.lease_ttl_s) or self.limits.default_lease_ttl_s
            self.quotas.check_leases(caller.client)
            lease_id, refs = self.store.get_shm(keys, ttl, owner=caller.tag)
            handles = []
            for ref in refs:
                if not isinstance(ref, ShmRef):
                    break
                handles.append(
                    pb.ShmHandle(region=ref.region, offset=ref.offset, length=ref.length)
                )
            if lease_id is not None and not handles:
                # the lease id travels with handles only: with none, no client could release it
                with contextlib.suppress(NotFound):  # it may have lapsed while bytes were read
                    self.store.release(lease_id)
                lease_id = None
            if lease_id is not None:
                self.quotas.lease_taken(caller.client, lease_id, ttl)
            return pb.ShmBatch(matched=len(refs), lease_id=lease_id or 0, handles=handles)

        return self._call("GetShm", context, run)

    def _encode(
        self, keys: list[bytes], payloads: list, lease_id: int | None, stream
    ) -> Iterator[bytes]:
        """Chunk messages made one at a time, each with one copy out of its DRAM slot.

        Copying every payload up front (under the store's lock) held the whole answer in
        memory and kept the wire idle meanwhile; this copies each chunk while the one
        before is on its way, then ends the lease that kept the slots from reuse.
        """
        try:
            for key, payload in zip(keys, payloads):
                yield wire.encode_chunk(key, payload)
        finally:
            stream.__exit__(None, None, None)
            if lease_id is not None:
                with contextlib.suppress(NotFound):  # expired: the call outlived its deadline
                    self.store.release(lease_id)

    def Put(self, request_iterator, context):
        def run(caller: Caller):
            with self.quotas.stream(caller.client):
                return put(caller)

        def put(caller: Caller):
            stored = dups = 0
            rejected = []
            for records in request_iterator:
                if isinstance(records, _Malformed):
                    raise _Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed PutRequest: {records.error}",
                        "invalid_argument",
                    )
                nbytes = sum(memoryview(r.payload).nbytes for r in records)
                self._wire("in", nbytes)
                records = self._check_put(records, caller)
                with self.quotas.inflight(caller.client, nbytes):
                    result = self.store.put(records, owner=caller.tag)
                stored += result.stored
                dups += result.duplicates
                rejected += result.rejected
            # chunks the store refused are counted by the store, under fixed codes
            return pb.PutResponse(
                stored=stored,
                duplicates=dups,
                rejected=[pb.Rejected(key=k, reason=r) for k, r in rejected],
            )

        return self._call("Put", context, run)

    def _check_put(self, records: list[ChunkRecord], caller: Caller) -> list[ChunkRecord]:
        self._keys([r.key for r in records])
        for r in records:
            size = memoryview(r.payload).nbytes
            if size > self.limits.max_chunk_bytes:
                raise _Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"chunk {r.key.hex()} is {size} bytes; max_chunk_bytes is "
                    f"{self.limits.max_chunk_bytes}",
                    "too_large",
                )
            if r.parent is not None and len(r.parent) != 16:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"parent of {r.key.hex()} is {len(r.parent)} bytes; keys are 16 bytes",
                    "invalid_argument",
                )
            if r.parent is None and len(r.ns) != 32:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk {r.key.hex()} starts a chain, so it needs a 32-byte namespace "
                    f"digest (got {len(r.ns)} bytes)",
                    "invalid_argument",
                )
        if caller.tag is None:
            return records
        return [
            r if r.parent is not None else dataclasses.replace(r, ns=tag_namespace(caller, r.ns))
            for r in records
        ]

    def ReserveShm(self, request, context):
        def run(caller: Caller):
            self._shm_allowed(context, instead="Put")
            chunks = [
                (bytes(c.key), bytes(c.parent) or None, bytes(c.namespace), c.length)
                for c in request.chunks
            ]
            self._keys([c[0] for c in chunks])
            chunks = [
                (k, p, tag_namespace(caller, ns) if p is None and len(ns) == 32 else ns, n)
                for k, p, ns, n in chunks
            ]
            ttl = self._ttl(request.ttl_s) or self.limits.default_lease_ttl_s
            ticket, refs, stored = self.store.reserve_shm(chunks, ttl, owner=caller.tag)
            handles = [
                pb.ShmHandle(region=r.region, offset=r.offset, length=r.length)
                if r is not None
                else pb.ShmHandle()
                for r in refs
            ]
            return pb.ShmReservation(ticket=ticket or 0, handles=handles, stored=stored)

        return self._call("ReserveShm", context, run)

    def CommitShm(self, request, context):
        def run(caller: Caller):
            self._shm_allowed(context, instead="Put")
            result = self.store.commit_shm(request.ticket, owner=caller.tag)
            return pb.PutResponse(
                stored=result.stored,
                duplicates=result.duplicates,
                rejected=[pb.Rejected(key=k, reason=r) for k, r in result.rejected],
            )

        return self._call("CommitShm", context, run)

    def _shm_allowed(self, context, instead: str) -> None:
        if not self.limits.shm:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server does not offer shared memory (server.shm=false); use {instead}",
                "shm_disabled",
            )
        if not _is_local(context.peer()):
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shared memory is only for clients on the store's own host; use {instead}",
                "shm_not_local",
            )

    def Release(self, request, context):
        def run(caller: Caller):
            self.store.release(request.lease_id)
            self.quotas.lease_ended(caller.client, request.lease_id)
            return pb.ReleaseResponse()

        return self._call("Release", context, run)

    def Delete(self, request, context):
        def run(caller: Caller):
            keys = self._keys(request.keys)
            if not keys and not request.namespace:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "name keys or a namespace to delete",
                    "invalid_argument",
                )
            removed = self.store.delete(keys, owner=caller.tag) if keys else 0
            if request.namespace:
                ns = tag_namespace(caller, bytes(request.namespace))
                removed += self.store.delete_namespace(ns)
            return pb.DeleteResponse(removed=removed)

        return self._call("Delete", context, run)

    def Stats(self, request, context):
        def run(caller: Caller):
            s = self.store.stats()
            from kvstore import __version__

            if caller.tag is not None and not caller.admin:
                return self._tenant_stats(caller, s, __version__)
            return pb.StatsResponse(
                tiers=[pb.TierStats(**_slots(t)) for t in s.tiers],
                chunks=s.chunks,
                lookups=s.lookups,
                lookup_keys=s.lookup_keys,
                lookup_hit_keys=s.lookup_hit_keys,
                put_chunks=s.put_chunks,
                put_duplicates=s.put_duplicates,
                rejected=s.rejected,
                active_leases=s.active_leases,
                expired_leases=s.expired_leases,
                reservations=s.reservations,
                namespaces=s.namespaces,
                write_policy=s.write_policy,
                version=__version__,
                uptime_s=time.monotonic() - self.started,
            )

        return self._call("Stats", context, run)

    def _tenant_stats(self, caller: Caller, s, version: str) -> pb.StatsResponse:
        """A tenant sees its own namespaces and chunk count; the rest is not its business."""
        mine = {
            shown_namespace(caller, ns): n
            for ns, n in s.namespaces.items()
            if owns(caller, bytes.fromhex(ns))
        }
        return pb.StatsResponse(
            chunks=sum(mine.values()),
            namespaces=mine,
            write_policy=s.write_policy,
            version=version,
            uptime_s=time.monotonic() - self.started,
        )

    def Explain(self, request, context):
        def run(caller: Caller):
            ns = bytes(request.namespace)
            e = explain(
                self.store,
                self._keys(request.keys),
                tag_namespace(caller, ns) if len(ns) == 32 else ns or None,
                request.lease_id or None,
                owner=caller.tag,
            )
            return pb.ExplainResponse(
                matched=e.matched,
                reason=e.reason,
                detail=e.detail,
                tier=e.tier or "",
                seconds_ago=e.seconds_ago or 0.0,
                tiers=e.tiers,
            )

        return self._call("Explain", context, run)


def _host_of(peer: str) -> str:
    """``ipv4:127.0.0.1:5555`` -> ``127.0.0.1``; ``unix:...`` stays whole."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.split(":", 1)[1].rsplit(":", 1)[0]
    return peer


def _is_local(peer: str) -> bool:
    host = _host_of(peer)
    return peer.startswith("unix:") or host.startswith("127.") or host in ("[::1]", "::1")


def _slots(obj) -> dict:
    return {f: getattr(obj, f) for f in obj.__slots__}


def generic_handler(service: KVStoreService) -> grpc.GenericRpcHandler:
    """Method handlers for ``kvstore.v1.KVStore``; Get and Put bypass protobuf for payloads."""

    def unary(fn, req):
        return grpc.unary_unary_rpc_method_handler(
            _checked(service, fn), request_deserializer=_parser(req), response_serializer=_serialize
        )

    handlers = {
        "Lookup": unary(service.Lookup, pb.LookupRequest),
        "Get": grpc.unary_stream_rpc_method_handler(
            _checked(service, service.Get), request_deserializer=_parser(pb.GetRequest)
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
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _serialize(message) -> bytes:
    return message.SerializeToString()


class _Malformed:
    """A PutRequest that did not parse; raising here would reach the client as INTERNAL."""

    def __init__(self, error: str) -> None:
        self.error = error


def _parser(cls) -> Callable[[bytes], object]:
    """``cls.FromString`` that hands a parse failure to the handler instead of raising.

    A deserializer that raises makes gRPC answer INTERNAL ("Exception deserializing
    request!"), blaming the server for the client's bytes.
    """

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError and whatever else bad bytes provoke
            return _Malformed(f"malformed {cls.DESCRIPTOR.name}: {exc}")

    return parse


def _checked(service: KVStoreService, fn):
    """``fn`` for well-formed requests; INVALID_ARGUMENT (counted) for malformed ones."""
    method = fn.__name__

    def handler(request, context):
        if isinstance(request, _Malformed):
            return service._call(method, context, lambda caller: _refuse(request))
        return fn(request, context)

    return handler


def _refuse(request: _Malformed):
    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, request.error, "malformed_request")


def _parse_put(data: bytes) -> list[ChunkRecord] | _Malformed:
    try:
        return wire.parse_put_request(data)
    except InvalidArgument as exc:
        return _Malformed(str(exc))
