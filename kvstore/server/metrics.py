"""Prometheus metrics for the store; the only module that imports ``prometheus_client``.

``Metrics(stats_fn)`` owns a private ``CollectorRegistry`` (never the global one, so
several servers can live in one process) and offers:

- ``observe_rpc(method, seconds, code)``, ``rejected(reason, n)`` and
  ``bytes_transferred(direction, n)``: events the gRPC service reports as they happen;
- ``watch_puts(inflight_fn, pooled_fn)``: what a service holds for puts, read at
  each scrape (the store's own, and its put process's pooled bytes, added up);
- ``put_process_call(code)``: a relayed call was the put process's;
- ``serve_http(listen)``: the ``/metrics`` endpoint on ``"host:port"`` (port 0 picks
  a free one), returned as a ``MetricsEndpoint`` with ``.port`` and ``.close()``;
- ``render()``: the exposition text, for tests and ``kvstore stats``.

What the store already counts is not counted twice: a collector calls ``stats_fn()``
once per scrape and exports the ``StoreStats`` it returns.

Every label has a bounded set of values: ``reason`` takes only the fixed codes in
``REJECT_REASONS`` / ``STORE_REJECT_REASONS`` (anything else is counted as
``other``, and every code is exported from the start, at 0), ``code`` is a gRPC
status name, ``method`` an RPC name, ``tier`` a configured tier, ``direction``
``in`` or ``out``.

Exported metrics (counters end in ``_total``; label in braces):

Events (updated by the service)
    kvstore_rpc_duration_seconds{method}      histogram, 50us..10s buckets; a Get is
                                              timed until its last chunk is sent
    kvstore_rpc_total{method,code}            RPCs finished, by gRPC status name
    kvstore_rejected_requests_total{reason}   requests refused by the service
    kvstore_wire_bytes_total{direction}       payload bytes on the wire, "in" or "out"
    kvstore_put_inflight_bytes                gauge, put bytes held in flight now
                                              (counted against the per-client limit)
    kvstore_put_buffers_pooled_bytes          gauge, idle part buffers kept for reuse
    kvstore_put_process_calls_total{code}     Put calls the put process answered
                                              (``kvstore.server.put_metrics``: its
                                              calls, refusals and wire bytes are in the
                                              metrics above, its pooled bytes added in)
    kvstore_put_process_up                    gauge, 1 while the put process serves
    kvstore_put_process_restarts              gauge, its restarts since the store started
Per tier (from TierStats)
    kvstore_tier_capacity_bytes{tier}         gauge
    kvstore_tier_used_bytes{tier}             gauge
    kvstore_tier_chunks{tier}                 gauge
    kvstore_tier_occupancy_ratio{tier}        gauge, used / capacity
    kvstore_tier_hits_total{tier}
    kvstore_tier_bytes_in_total{tier}
    kvstore_tier_bytes_out_total{tier}
    kvstore_tier_evictions_total{tier}
    kvstore_tier_demotions_total{tier}        demotions into the tier
    kvstore_tier_promotions_total{tier}       promotions into the tier
    kvstore_tier_corrupt_total{tier}
Store-wide (from StoreStats)
    kvstore_chunks                            gauge
    kvstore_lookups_total
    kvstore_lookup_keys_total
    kvstore_lookup_hit_keys_total
    kvstore_misses_total
    kvstore_put_batches_total
    kvstore_put_chunks_total
    kvstore_put_duplicates_total
    kvstore_store_rejected_total{reason}      chunks the store refused
    kvstore_active_leases                     gauge
    kvstore_expired_leases_total
    kvstore_namespaces                        gauge
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.server.stats import StoreStats

# From a shm slot read (tens of µs) to a large streamed Get over a slow link (seconds).
# fmt: off
RPC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# fmt: on
DIRECTIONS = ("in", "out")
OTHER = "other"
# Why the service refused a request (kvstore_rejected_requests_total{reason}).
REJECT_REASONS = (
    "bad_payload",
    "bad_ttl",
    "failed_precondition",
    "invalid_argument",
    "malformed_request",
    "not_found",
    "shm_disabled",
    "shm_not_local",
    "shutting_down",
    "tiers_full",
    "too_large",
    "too_many_bytes",
    "too_many_keys",
    "too_many_leases",
    "too_many_streams",
    "unauthenticated",
    OTHER,
)
# Why the store refused a chunk (kvstore_store_rejected_total{reason}).
STORE_REJECT_REASONS = (
    "bad_payload",
    "in_flight",
    "key_conflict",
    "parent_not_stored",
    "parent_rejected",
    "tiers_full",
    "too_large",
    "write_failed",
    "write_through_full",
    OTHER,
)

# (metric suffix, TierStats field, help) for the per-tier counters.
_TIER_COUNTERS = (
    ("hits", "hits", "Chunks read from the tier."),
    ("bytes_in", "bytes_in", "Bytes written into the tier."),
    ("bytes_out", "bytes_out", "Bytes read out of the tier."),
    ("evictions", "evictions", "Chunks evicted from the tier."),
    ("demotions", "demotions_in", "Chunks demoted into the tier from the tier above."),
    ("promotions", "promotions_in", "Chunks promoted into the tier from a lower tier."),
    ("corrupt", "corrupt", "Corrupt values found in the tier and dropped."),
)
_STORE_COUNTERS = (
    ("lookups", "lookups", "Lookup calls."),
    ("lookup_keys", "lookup_keys", "Keys asked for by lookups."),
    ("lookup_hit_keys", "lookup_hit_keys", "Keys found by lookups (the matched prefixes)."),
    ("misses", "misses", "Gets that stopped before the last key asked for."),
    ("put_batches", "puts", "Put batches."),
    ("put_chunks", "put_chunks", "Chunks stored by puts."),
    ("put_duplicates", "put_duplicates", "Chunks put that were already stored."),
    ("expired_leases", "expired_leases", "Leases that expired before being released."),
)


class StoreCollector:
    """Exports a ``StoreStats`` snapshot, taken once per scrape."""

    def __init__(self, stats_fn: Callable[[], StoreStats]) -> None:
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        s = self._stats_fn()
        yield from self._tiers(s)
        yield GaugeMetricFamily("kvstore_chunks", "Chunks in the index.", value=s.chunks)
        for suffix, attr, help_text in _STORE_COUNTERS:
            yield CounterMetricFamily(f"kvstore_{suffix}", help_text, value=getattr(s, attr))
        rejected = CounterMetricFamily(
            "kvstore_store_rejected", "Chunks the store refused, by reason.", labels=["reason"]
        )
        counts = dict.fromkeys(STORE_REJECT_REASONS, 0)
        for reason, n in s.rejected.items():
            counts[reason if reason in counts else OTHER] += n
        for reason, n in counts.items():
            rejected.add_metric([reason], n)
        yield rejected
        yield GaugeMetricFamily("kvstore_active_leases", "Leases held now.", value=s.active_leases)
        yield GaugeMetricFamily(
            "kvstore_namespaces", "Namespaces with stored chunks.", value=len(s.namespaces)
        )

    @staticmethod
    def _tiers(s: StoreStats) -> Iterator[Metric]:
        def gauge(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvstore_tier_{name}", help_text, labels=["tier"])

        capacity = gauge("capacity_bytes", "Bytes the tier can hold.")
        used = gauge("used_bytes", "Bytes the tier holds.")
        chunks = gauge("chunks", "Chunks the tier holds.")
        occupancy = gauge("occupancy_ratio", "Used bytes over capacity, 0 to 1.")
        counters = [
            (CounterMetricFamily(f"kvstore_tier_{suffix}", help_text, labels=["tier"]), attr)
            for suffix, attr, help_text in _TIER_COUNTERS
        ]
        for t in s.tiers:
            capacity.add_metric([t.name], t.capacity_bytes)
            used.add_metric([t.name], t.used_bytes)
            chunks.add_metric([t.name], t.chunks)
            occupancy.add_metric(
                [t.name], t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
            )
            for family, attr in counters:
                family.add_metric([t.name], getattr(t, attr))
        yield from (capacity, used, chunks, occupancy)
        yield from (family for family, _ in counters)


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server; ``port`` is the one actually bound."""

    server: WSGIServer
    thread: threading.Thread
    port: int

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Metrics:
    def __init__(self, stats_fn: Callable[[], StoreStats]) -> None:
        self.registry = CollectorRegistry()
        self._rpc_seconds = Histogram(
            "kvstore_rpc_duration_seconds",
            "Time to serve an RPC, by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._rpcs = Counter(
            "kvstore_rpc_total",
            "RPCs finished, by method and gRPC status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self._rejected = Counter(
            "kvstore_rejected_requests_total",
            "Requests the service refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REJECT_REASONS:
            self._rejected.labels(reason)  # exported at 0, so rates and alerts see it from start
        self._wire = Counter(
            "kvstore_wire_bytes_total",
            "Chunk payload bytes received (in) and sent (out) over the wire.",
            ["direction"],
            registry=self.registry,
        )
        for direction in DIRECTIONS:
            self._wire.labels(direction)
        self._inflight = Gauge(
            "kvstore_put_inflight_bytes",
            "Put bytes held in flight now, counted against the per-client limit.",
            registry=self.registry,
        )
        self._pooled = Gauge(
            "kvstore_put_buffers_pooled_bytes",
            "Bytes of idle put part buffers kept for reuse.",
            registry=self.registry,
        )
        self._put_process_up = Gauge(
            "kvstore_put_process_up",
            "1 while the store's put process serves Put on its own port, else 0.",
            registry=self.registry,
        )
        self._put_process_restarts = Gauge(
            "kvstore_put_process_restarts",
            "Times the put process exited and was started again since the store started.",
            registry=self.registry,
        )
        self._put_process_calls = Counter(
            "kvstore_put_process_calls",
            "Put calls the put process answered, by gRPC status code (also in kvstore_rpc_*).",
            ["code"],
            registry=self.registry,
        )
        self._held: list[tuple[Callable[[], float], Callable[[], float]]] = []
        self._inflight.set_function(lambda: sum(f() for f, _ in self._held))
        self._pooled.set_function(lambda: sum(f() for _, f in self._held))
        self.registry.register(StoreCollector(stats_fn))

    def watch_puts(self, inflight_fn: Callable[[], float], pooled_fn: Callable[[], float]) -> None:
        """Export what a service holds for puts, read at each scrape: the store's own and
        its put process's (as last relayed) are added up."""
        self._held.append((inflight_fn, pooled_fn))

    def watch_put_process(
        self, up_fn: Callable[[], float], restarts_fn: Callable[[], float]
    ) -> None:
        """Export the put process's state, read at each scrape (0 until called)."""
        self._put_process_up.set_function(up_fn)
        self._put_process_restarts.set_function(restarts_fn)

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        self._rpc_seconds.labels(method).observe(seconds)
        self._rpcs.labels(method, code).inc()

    def put_process_call(self, code: str) -> None:
        """One of the calls ``observe_rpc`` counted was the put process's."""
        self._put_process_calls.labels(code).inc()

    def rejected(self, reason: str, n: int = 1) -> None:
        self._rejected.labels(reason if reason in REJECT_REASONS else OTHER).inc(n)

    def bytes_transferred(self, direction: str, n: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self._wire.labels(direction).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, listen: str) -> MetricsEndpoint:
        """Serve ``/metrics`` on ``"host:port"`` (``"[::1]:0"`` for IPv6) in a daemon thread."""
        host, port = _split_listen(listen)
        server, thread = start_http_server(port, host, registry=self.registry)
        return MetricsEndpoint(server, thread, server.server_port)


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics listen address must be 'host:port', got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
