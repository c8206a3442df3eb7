"""``KVStoreConnector``: the vLLM KV-connector (API v1) facade over the two halves.

Load it with::

    kv_transfer_config={"kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "connector.vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": "127.0.0.1:50051",
                                                      "codec": "fp8"}}

The scheduler process gets a ``SchedulerHalf`` (lookups and plans), each worker
a ``WorkerHalf`` (loads and saves). ``kv_producer`` only saves, ``kv_consumer``
only loads, ``kv_both`` does both. Behind a P/D proxy (vllm-router) the prefill
server's finished request returns ``kv_transfer_params`` naming the chunks it saved,
and the decode server waits for them (``connector.handoff``).

A load that fails costs only a recompute when vLLM is told so
(``"kv_load_failure_policy": "recompute"`` in ``kv_transfer_config``); with
vLLM's default ``fail`` the request fails, and the connector says so at start.
Pipeline parallelism is refused at start: a stage's chunks would carry only
its own layers under keys the other stages share. The facade only hands each hook
to its half; neither half ever lets a store failure raise into the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connector.config import ConnectorConfig, ConnectorConfigError
from connector.namespace import engine_namespace
from connector.plan import KVStoreMetadata
from connector.scheduler import SchedulerHalf
from connector.stats import CounterDeltas, KVStoreConnectorStats, KVStorePromMetrics
from connector.worker import WorkerHalf

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, block_size)
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:
            raise ConnectorConfigError(
                f"KVStoreConnector does not support pipeline parallelism "
                f"(pipeline_parallel_size={pp}): each stage holds only its own layers, and "
                "stages would store and load each other's chunks under the same keys; run "
                "with tensor parallelism only"
            )
        namespace = engine_namespace(
            vllm_config, self.config.chunk_tokens, self.config.codec, self.config.namespace_salt
        )
        role_name = transfer.kv_role or "kv_both"
        load = role_name in ("kv_both", "kv_consumer")
        save = role_name in ("kv_both", "kv_producer")
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._deltas: CounterDeltas | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(
                self.config, namespace, block_size, load=load, save=save
            )
            policy = getattr(transfer, "kv_load_failure_policy", "fail")
            if load and policy != "recompute":
                log.warning(
                    "kvstore connector: kv_load_failure_policy is %r, so vLLM fails a request "
                    "whose load from the store fails (store restarted, chunk evicted, network "
                    'error) instead of recomputing it; set "kv_load_failure_policy": '
                    '"recompute" in kv_transfer_config',
                    policy,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from connector.layouts import layout_for

            self._worker = WorkerHalf(
                self.config,
                namespace,
                block_size,
                get_tensor_model_parallel_rank(),
                lambda kv, name: layout_for(kv, vllm_config, layer_name=name),
            )
        log.info("kvstore connector (%s, %s) -> %s", role.name, role_name, self.config.store)

    # ---- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Whole chunks the store holds, or None (asked again next step) while the request
        waits for chunks a P/D prefill node or another engine is computing."""
        tokens = self._scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self.config.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, num_external_tokens, blocks)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        """The workers' counters for the step feed the load planner (``connector.planner``)."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        if isinstance(stats, KVStoreConnectorStats) and stats.data:
            self._scheduler.worker_stats(stats.data)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks are free at once (saves were copied out in ``wait_for_save``); the prefill
        leg of a P/D proxy returns the ``kv_transfer_params`` its decode leg waits on."""
        return False, self._scheduler.finished(request)

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Called just before each forward (``start_load_kv`` comes after it when the step
        has no synchronous load): the load planner times the forward from here."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVStoreMetadata):
            self._worker.step_started(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVStoreMetadata) and meta.loads:
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``load_layerwise`` (CPU), until the step's loads wrote this layer; else
        synchronous loads finished in ``start_load_kv``, before the first layer ran, and
        background loads (``load_async``) hold their request out of the batch instead."""
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Chunks are saved whole, after the last layer, in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Copies this step's chunks out of the cache; sending happens in the background."""
        meta = self._get_connector_metadata()
        if isinstance(meta, KVStoreMetadata):
            self._worker.step_ended()
            if meta.saves:
                self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        """Nothing is ever sent from blocks vLLM must keep; background loads (``load_async``)
        that ended are reported as received, failed or not (their bad blocks go out
        through ``get_block_ids_with_load_errors`` in the same pass)."""
        if self._worker is None:
            return None, None
        if finished_req_ids:
            self._worker.finished(finished_req_ids)
        return None, self._worker.loads_done() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    # ---- stats (both sides) -----------------------------------------------------------

    def get_kv_connector_stats(self):
        """What this half's counters gained since vLLM last asked (None when nothing)."""
        half = self._worker or self._scheduler
        if half is None:
            return None
        if self._deltas is None:
            self._deltas = CounterDeltas(half.counters)
        return self._deltas.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler):
            if half is not None:
                half.close()
                log.info("kvstore connector %s counters: %s", self.role.name, half.counters)
