"""What every RPC of the servicer shares: limits, request checks and the call wrapper.

Offers ``Limits``, ``Abort`` (a refusal with its status code and fixed reason),
``host_of``, ``is_local``, ``client_of`` and ``ServiceCalls``, the base of
``KVStoreService``: ``_call`` runs an RPC's body with draining, authentication, error
mapping and metrics, ``_streamed`` times a response stream to its last message, and
``_keys``/``_ttl``/``_reserve_ttl`` check request fields.
It never answers a client's mistake with ``INTERNAL``: a refusal names the field.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote

import grpc

from kvstore.core.types import (
    InvalidArgument,
    KVStoreError,
    NotFound,
    PayloadError,
    TierFullError,
)
from kvstore.rpc.local_wire import on_this_host
from kvstore.server.auth import Caller, Tenants, Unauthenticated
from kvstore.server.part_buffers import PartBuffers
from kvstore.server.quotas import QuotaExceeded, Quotas
from kvstore.server.store import TieredStore

log = logging.getLogger("kvstore.server.service")

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


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def host_of(peer: str) -> str:
    """``ipv4:127.0.0.1:5555`` -> ``127.0.0.1``, ``ipv6:%5B::1%5D:5555`` (gRPC escapes the
    brackets) -> ``[::1]``; ``unix:...`` stays whole."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return unquote(peer.split(":", 1)[1].rsplit(":", 1)[0])
    return peer


def is_local(peer: str) -> bool:
    """Whether the caller is on the store's own host (loopback, or a Unix socket)."""
    return on_this_host(unquote(peer))


def client_of(peer: str) -> str:
    """Who a caller without a token is to the quotas: its host. Every caller on the
    store's own host is one client, whichever loopback address, Unix socket or the
    store's same-host socket it came by (a lease taken one way may be released another)."""
    return "peer:local" if is_local(peer) else f"peer:{host_of(peer)}"


class ServiceCalls:
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
        self.part_buffers = PartBuffers()  # chunks put in parts are gathered in these
        if metrics is not None:
            metrics.watch_puts(self.quotas.inflight_bytes, lambda: self.part_buffers.pooled_bytes)
        self.started = time.monotonic()
        self._draining = threading.Event()
        # set by whoever starts a put process for this store; Routes tells clients
        self.put_port: int | None = None
        # set by the server that answers same-host calls on a Unix socket too (Routes)
        self.local_socket = ""

    def drain(self) -> None:
        """Refuse new calls with UNAVAILABLE while in-flight ones finish."""
        self._draining.set()

    def _keys(self, keys) -> list[bytes]:
        if len(keys) > self.limits.max_keys_per_request:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys in one request; the limit is {self.limits.max_keys_per_request}",
                "too_many_keys",
            )
        keys = list(keys)
        # one pass at C speed for the common case (512-key lookups); find the culprit after
        if any(n != 16 for n in map(len, keys)):
            i, key = next((i, k) for i, k in enumerate(keys) if len(k) != 16)
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"keys[{i}] is {len(key)} bytes; chunk keys are 16 bytes (xxh3-128)",
                "invalid_argument",
            )
        return keys

    def _reserve_ttl(self, request) -> float:
        ttl = request.reserve_ttl_s
        if not (0 < ttl <= self.limits.max_lease_ttl_s):  # also refuses NaN
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reserve_ttl_s must be in (0, {self.limits.max_lease_ttl_s}], got {ttl}",
                "bad_ttl",
            )
        if len(request.holder) > 256:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "holder must be at most 256 bytes",
                "invalid_argument",
            )
        return ttl

    def _ttl(self, ttl: float) -> float | None:
        # NaN passes both range checks below; a NaN expiry never comes, and at the top of
        # the lease heap it would keep every later lease from expiring too
        if math.isnan(ttl) or ttl < 0:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"lease_ttl_s must be >= 0, got {ttl}", "bad_ttl"
            )
        if ttl > self.limits.max_lease_ttl_s:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ttl_s={ttl} exceeds the server's max_lease_ttl_s="
                f"{self.limits.max_lease_ttl_s}",
                "bad_ttl",
            )
        return ttl or None

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        if self.tenants is None:
            return Caller(client=client_of(context.peer()))
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
                raise Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down", "shutting_down")
            result = fn(self._caller(context))
            if stream:
                result, t0 = self._streamed(method, t0, result), None
            return result
        except QuotaExceeded as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self._reject(exc.reason)
            context.abort(code, str(exc))
        except Abort as exc:
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
