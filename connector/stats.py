"""The connector's counters, reported through vLLM's KV-connector stats and exported on
vLLM's own ``/metrics``.

Offers ``KVStoreConnectorStats`` (vLLM's ``KVConnectorStats``: counter deltas that add
up across workers and intervals), ``CounterDeltas(counters)`` (what a half's counters
gained since the last report) and ``KVStorePromMetrics`` (one counter
``vllm:kvstore_<name>_total`` per field of the halves' counters, labelled per engine).
Every field of ``SchedulerCounters`` and ``WorkerCounters`` is exported as it is, so
a new counter needs no change here. Never raises into the engine: a report that
cannot be made is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from connector.scheduler import SchedulerCounters
from connector.worker import WorkerCounters

HELP = {
    "lookups": "Store lookups the scheduler made",
    "lookup_failures": "Store lookups that failed or timed out (store unreachable)",
    "lookup_tokens": "Prompt tokens looked up in the store",
    "hit_tokens": "Prompt tokens the store held (external prefix hits)",
    "loaded_tokens": "Tokens loaded from the store into the KV cache",
    "loaded_chunks": "Chunks loaded from the store",
    "loaded_bytes": "Payload bytes loaded from the store",
    "load_seconds": "Seconds spent loading (store call to the last block written)",
    "load_fetch_seconds": "Of load_seconds, getting the bytes (shared memory or gRPC)",
    "load_decode_seconds": "Of load_seconds, decoding them (the rest is writing the blocks)",
    "saved_bytes": "Payload bytes the store took",
    "save_seconds": "Seconds spent encoding and sending saves (background: the engine never waits)",
    "load_failures": "Loads that failed or came back short (recomputed)",
    "granted_loads": "Loads read where the scheduler's lookup found them in shared memory",
    "timed_tokens": "Tokens of the forwards the load planner timed (prefill, no load)",
    "timed_seconds": "Seconds of those forwards (the planner's compute speed)",
    "planner_skipped_tokens": "Hit tokens computed instead: measured slower to load than compute",
    "layerwise_loads": "Steps whose loads were written a layer at a time during the forward",
    "layer_waits": "Attention layers that waited for their layer of those loads",
    "layer_wait_seconds": "Seconds the forward waited for those layers",
    "saved_chunks": "Chunks sent to the store",
    "save_skipped": "Chunks not saved (queue full, or their chain had ended)",
    "save_failures": "Chunks that failed to copy, encode or send, or were refused",
}
FIELDS = tuple(
    dict.fromkeys(
        f.name for cls in (SchedulerCounters, WorkerCounters) for f in dataclasses.fields(cls)
    )
)


class KVStoreConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """What a counters dataclass gained since the previous ``take``."""

    def __init__(self, counters) -> None:
        self._counters = counters
        self._last: dict[str, Any] = {}

    def take(self) -> KVStoreConnectorStats | None:
        now = {
            k: v
            for k, v in dataclasses.asdict(self._counters).items()
            if isinstance(v, (int, float))
        }
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return KVStoreConnectorStats(data=delta) if delta else None


class KVStorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._per_engine: dict[str, dict[int, Any]] = {}
        for name in FIELDS:
            counter = self._counter_cls(
                name=f"vllm:kvstore_{name}",
                documentation=HELP.get(name, f"kvstore connector counter {name}"),
                labelnames=labelnames,
            )
            self._per_engine[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._per_engine.get(name)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)
