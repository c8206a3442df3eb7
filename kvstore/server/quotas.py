"""Per-client limits, so one client cannot starve the others. Thread-safe, no I/O.

Offers ``Quotas(max_leases, max_streams, max_inflight_bytes)`` with ``stream(client)``
(a context manager around a Get or Put stream), ``inflight(client, nbytes)`` (bytes of
a Put being stored; ``inflight_bytes()`` reads the total) and ``lease_taken`` /
``lease_ended`` / ``check_leases``. A client is a tenant, or a peer address when there
are no tenants. Going over a limit raises ``QuotaExceeded``, which the service answers
with RESOURCE_EXHAUSTED and a message naming the limit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from kvstore.core.types import KVStoreError


class QuotaExceeded(KVStoreError):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Quotas:
    def __init__(
        self,
        max_leases: int,
        max_streams: int,
        max_inflight_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_leases = max_leases
        self.max_streams = max_streams
        self.max_inflight_bytes = max_inflight_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: dict[str, int] = defaultdict(int)
        self._bytes: dict[str, int] = defaultdict(int)
        self._leases: dict[str, dict[int, float]] = defaultdict(dict)  # lease id -> expiry

    @contextlib.contextmanager
    def stream(self, client: str) -> Iterator[None]:
        with self._lock:
            if self._streams[client] >= self.max_streams:
                raise QuotaExceeded(
                    f"{self._streams[client]} streams already open for this client; "
                    f"the limit is {self.max_streams} (server.max_streams_per_client)",
                    "too_many_streams",
                )
            self._streams[client] += 1
        try:
            yield
        finally:
            with self._lock:
                self._streams[client] -= 1

    @contextlib.contextmanager
    def inflight(self, client: str, nbytes: int) -> Iterator[None]:
        with self._lock:
            if self._bytes[client] and self._bytes[client] + nbytes > self.max_inflight_bytes:
                raise QuotaExceeded(
                    f"{self._bytes[client]} B of puts already in flight for this client; "
                    f"the limit is {self.max_inflight_bytes} B "
                    "(server.max_inflight_bytes_per_client)",
                    "too_many_bytes",
                )
            self._bytes[client] += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._bytes[client] -= nbytes

    def inflight_bytes(self) -> int:
        """Put bytes counted in flight now, all clients together."""
        with self._lock:
            return sum(self._bytes.values())

    def check_leases(self, client: str) -> None:
        """Refuse a new lease when the client holds its limit of unexpired ones."""
        now = self._clock()
        with self._lock:
            held = self._leases[client]
            for lease_id in [i for i, expiry in held.items() if expiry <= now]:
                del held[lease_id]
            if len(held) >= self.max_leases:
                raise QuotaExceeded(
                    f"this client holds {len(held)} leases; the limit is {self.max_leases} "
                    "(server.max_leases_per_client): release leases when done",
                    "too_many_leases",
                )

    def lease_taken(self, client: str, lease_id: int, ttl_s: float) -> None:
        with self._lock:
            self._leases[client][lease_id] = self._clock() + ttl_s

    def lease_ended(self, client: str, lease_id: int) -> None:
        with self._lock:
            self._leases[client].pop(lease_id, None)
