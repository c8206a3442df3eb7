"""The scheduler half: which prefix the store can supply, and the per-step load/save plan.

Offers ``SchedulerHalf`` with ``matched_tokens(request, num_computed_tokens)``,
``after_alloc(request, num_external_tokens, blocks)``, ``build_meta(scheduler_output)``
and ``finished(request)``. It keys a request's chunks with kvstore's own key
spec (its LoRA adapter, cache salt and multimodal inputs included, see
``connector.identity``), asks the store with one ``Lookup`` per tensor-parallel
rank, all at once (each bounded by ``lookup_timeout_s``), and never reports the whole sequence: at
least one token is always left to compute. Any store failure means "0 tokens".
On the store's host a lookup that leases a hit also gets the chunks' places in shared
memory; the load hands each rank's lease and places to that rank's worker, which
reads with no GetShm of its own and ends the lease when its read is done.

Every request that vLLM counts external tokens for gets a load in the step it
is scheduled, whether it is new or resumed after a preemption (vLLM resets a
preempted request and asks again; its blocks are new). Saves cover the full
chunks of the prompt and, with ``save_generated``, of the generated tokens,
each chunk once: not those the lookup found stored, not those planned before.

A request waits (``None``: vLLM asks again next step; bounded by ``wait_timeout_s``)
for chunks another node is computing: those a prefill node said it saved
(``connector.handoff``), and, with ``single_flight``, those another engine reserved
at its lookup (``connector.coordination``). An engine with nothing else to run paces
its polls instead of spinning. A store that fails ends every wait: the request computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from connector.config import ConnectorConfig
from connector.coordination import NodeCoordination
from connector.identity import RequestChain, unkeyable
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from connector.planner import LoadPlanner
from connector.waits import Wait
from kvstore.core.keys import Namespace, part_key
from kvstore.core.types import ShmGrant

log = logging.getLogger(__name__)


@dataclass
class _Request:
    chain: RequestChain
    stored: int = 0  # leading chunks the store held (for every rank) at the last lookup
    load_tokens: tuple[int, int] | None = None  # [local computed, external end) to load
    allocated: bool = False  # vLLM allocated blocks for load_tokens: load this step
    lease_ids: list[int] = field(default_factory=list)
    # per rank: where the leased lookup found the chunks in shared memory (same host)
    grants: tuple[ShmGrant | None, ...] = ()
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading chunks stored or planned for saving; -1: saving given up
    wait: Wait | None = None  # waiting for chunks another node is computing
    waited: bool = False  # a wait ended (hit or timed out): never wait again
    claimed_at: float | None = None  # when this engine last reserved the chain's missing chunks


@dataclass
class SchedulerCounters:
    lookups: int = 0
    lookup_failures: int = 0
    lookup_tokens: int = 0  # tokens of whole chunks asked about
    hit_tokens: int = 0
    loads_planned: int = 0
    resumed_loads: int = 0
    chunks_planned: int = 0
    unkeyable: int = 0
    waits: int = 0  # requests that waited for another node's chunks
    wait_timeouts: int = 0  # waits that ended without the chunks (computed instead)
    reservations: int = 0  # lookups that made this engine the producer of missing chunks
    handoffs: int = 0  # finished prefill requests that told the decode node what they saved
    planner_skipped_tokens: int = 0  # hits computed: measured slower to load than to compute


class SchedulerHalf(NodeCoordination):
    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        block_size: int,
        *,
        load: bool = True,
        save: bool = True,
        client=None,
    ) -> None:
        self.config = config
        self.ns = namespace.digest()
        self.tp = namespace.tp_size
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_tokens // block_size
        self.load, self.save = load, save
        self._client = client
        self._reqs: dict[str, _Request] = {}
        self._pending: set[str] = set()  # requests with an allocated load not yet planned
        self._background: list[LoadSpec] = []  # load_async: planned, not yet sent
        self._logged: set[str] = set()
        self._idle = False  # the last step scheduled nothing
        self._pool: ThreadPoolExecutor | None = None  # tensor parallelism: ranks asked at once
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.counters = SchedulerCounters()
        self.planner = LoadPlanner(config.planner_min_speedup) if config.planner else None

    @property
    def lookup_failures(self) -> int:
        return self.counters.lookup_failures

    @property
    def client(self):
        if self._client is None:
            from kvstore.client.shards import connect

            opts = self.config.client_options(self.config.lookup_timeout_s)
            self._client = connect(self.config.store, opts)
        return self._client

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that the store can supply (whole chunks),
        or None while the request waits for chunks another node is computing.

        Called for new requests and again for each resumption after a preemption;
        a resumed request keeps its keys and what it already saved. Never raises:
        whatever goes wrong, the answer is 0 and vLLM computes.
        """
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:
            self._log_once("match", "kvstore: keying %s failed: %r", request.request_id, exc)
            state = self._reqs.pop(request.request_id, None)
            if state is not None:
                self._release(state)
            return 0

    def _matched(self, request, num_computed_tokens: int) -> int | None:
        state = self._reqs.get(request.request_id)
        if state is not None and state.wait is not None:
            pause = state.wait.next_poll - time.monotonic()
            if pause > 0:
                if not self._idle:
                    return None  # other requests are running: ask again next step
                time.sleep(pause)  # nothing else to run: pace the polls instead of spinning
        if state is None:
            why = unkeyable(request)
            if why is not None:
                self.counters.unkeyable += 1
                log.debug("kvstore: request %s not keyed: %s", request.request_id, why)
                return 0
            state = _Request(RequestChain(self.ns, request, self.config.chunk_tokens))
            self._reqs[request.request_id] = state
        else:
            self._release(state)
        state.load_tokens, state.allocated = None, False
        state.block_ids = []
        num_tokens = state.chain.num_tokens
        keys = state.chain.extend(num_tokens)
        if not keys or not (self.load or self.save):
            return 0
        reserve = self.save and self.config.single_flight and not state.waited
        # a lease only where this lookup's hit is likely loaded: not for a waiting request's
        # polls, nor for a hit the planner will compute; one found needed is taken below
        waiting = state.wait is not None
        planned = self.planner is None or self.planner.would_load() or self._is_handoff(request)
        usable = (num_tokens - 1) // self.config.chunk_tokens  # leave one token to compute
        # nor where vLLM's own prefix cache already holds every chunk that could be loaded
        beyond_local = usable * self.config.chunk_tokens > num_computed_tokens
        lease = self.load and not waiting and planned and beyond_local
        state.stored, pending, ok = self._lookup(state, keys, lease=lease, reserve=reserve)
        if self.load and self._keep_waiting(state, request, keys, pending, ok):
            self._release(state)
            return None
        self.counters.lookup_tokens += len(keys) * self.config.chunk_tokens
        if state.saved >= 0:
            state.saved = max(state.saved, state.stored)
        if not self.load:
            return 0
        hit = min(state.stored, usable) * self.config.chunk_tokens
        log.debug(
            "kvstore: %s has %d full chunks, %d stored; %d tokens computed here, %d in the store",
            request.request_id,
            len(keys),
            state.stored,
            num_computed_tokens,
            hit,
        )
        if hit <= num_computed_tokens:
            self._release(state)
            return 0
        if not self._worth_loading(request, state):
            self.counters.planner_skipped_tokens += hit - num_computed_tokens
            self._release(state)
            return 0
        if not state.lease_ids:  # the poll that ended a wait, or the planner's exploring load
            state.stored, _, ok = self._lookup(state, keys, lease=True, reserve=False)
            hit = min(state.stored, usable) * self.config.chunk_tokens if ok else 0
            if hit <= num_computed_tokens:
                self._release(state)
                return 0
        state.load_tokens = (num_computed_tokens, hit)
        return hit - num_computed_tokens

    def _worth_loading(self, request, state: _Request) -> bool:
        """The planner's answer; a request that waited for another node's chunks, or the
        decode leg of a P/D handoff, always loads them: that is what it waited for."""
        if self.planner is None or state.waited or self._is_handoff(request):
            return True
        return self.planner.worth_loading()

    def _lookup(
        self, state: _Request, keys: list[bytes], lease: bool, reserve: bool
    ) -> tuple[int, int, bool]:
        """Chunks every rank's part of which is stored (leased for loading when ``lease``),
        chunks after them another engine is computing, and whether the store answered.

        With ``reserve`` the missing rest is reserved to this engine unless another
        engine already computes it (single-flight; rank 0's keys stand for all ranks).
        """
        ttl = self.config.lease_ttl_s if lease else 0.0
        # same host: the leased chunks' places in shared memory come back with the lease,
        # so the workers read them without a GetShm round trip of their own
        shm = lease and self.config.same_host
        self.counters.lookups += 1

        def ask(rank: int):
            parts = [part_key(k, rank, self.tp) for k in keys]
            extra = {}
            if reserve and rank == 0:
                extra = {"reserve_ttl_s": self.config.reserve_ttl_s, "holder": self.holder}
            return self.client.lookup(parts, lease_ttl_s=ttl, shm=shm, **extra)

        try:
            if self.tp == 1:
                results = [ask(0)]
            else:  # every rank's part at once: one round trip, not one per rank
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.tp, thread_name_prefix="kvstore-lookup")
                futures = [self._pool.submit(ask, rank) for rank in range(self.tp)]
                results = [f.result() for f in futures]
            state.lease_ids += [r.lease_id for r in results if r.lease_id]
            if lease:
                state.grants = tuple(r.shm for r in results)
            matched = min(r.matched for r in results)
            pending = results[0].pending
            self.counters.reservations += results[0].reserved > 0
            if results[0].reserved:
                state.claimed_at = time.monotonic()
        except Exception as exc:  # a store that is down or slow must never stop the engine
            self.counters.lookup_failures += 1
            self._log_once("lookup", "kvstore lookup failed, computing instead: %s", exc)
            return 0, 0, False
        return matched, pending, True

    def after_alloc(self, request, num_external_tokens: int, blocks=None) -> None:
        """vLLM allocated blocks for ``num_external_tokens`` of the hit (maybe fewer than
        offered). A synchronous load is planned when the request is scheduled; with
        ``load_async`` the request is not scheduled until its load is done, so the load
        is planned now from ``blocks`` (all of the request's blocks)."""
        state = self._reqs.get(request.request_id)
        if state is None or state.load_tokens is None:
            return
        if num_external_tokens == 0:
            state.load_tokens = None
            self._release(state)
            return
        local, _ = state.load_tokens
        state.load_tokens = (local, local + num_external_tokens)
        self.counters.hit_tokens += num_external_tokens
        if self.config.load_async and blocks is not None:
            state.block_ids = list(blocks.get_block_ids()[0])
            state.allocated = True
            self._background.append(self._load_spec(request.request_id, state, True))
            return
        state.allocated = True
        self._pending.add(request.request_id)

    def build_meta(self, out) -> KVStoreMetadata:
        meta = KVStoreMetadata()
        self._idle = not getattr(out, "total_num_scheduled_tokens", 1)
        meta.loads, self._background = self._background, []
        meta.scheduled_tokens = getattr(out, "total_num_scheduled_tokens", 0)
        return self._build_meta(out, meta)

    def worker_stats(self, data: dict) -> None:
        """The workers' counter deltas for a step (vLLM hands them to the scheduler)."""
        if self.planner is not None:
            self.planner.loaded(data.get("loaded_tokens", 0), data.get("load_seconds", 0.0))
            self.planner.computed(data.get("timed_tokens", 0), data.get("timed_seconds", 0.0))

    def _build_meta(self, out, meta: KVStoreMetadata) -> KVStoreMetadata:
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            state = self._reqs.get(req_id)
            if state is not None:
                state.block_ids = []  # freed; the resumption brings new ones
        for new in out.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_load(new.req_id, state, meta)
            self._plan_save(new.req_id, state, new.num_computed_tokens, out, meta)
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                # a resumed request holds only new blocks, all of them listed here
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
                if state.load_tokens is not None:
                    self.counters.resumed_loads += 1
                self._plan_load(req_id, state, meta)
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._plan_save(req_id, state, cached.num_computed_tokens[i], out, meta)
        for req_id in self._pending:  # allocated yet not scheduled: vLLM never does this
            log.warning("kvstore: request %s was allocated a load but not scheduled", req_id)
            state = self._reqs.get(req_id)
            if state is not None:
                state.load_tokens, state.allocated = None, False
        self._pending.clear()
        return meta

    def _plan_load(self, req_id: str, state: _Request, meta: KVStoreMetadata) -> None:
        if state.load_tokens is None or not state.allocated:
            return
        self._pending.discard(req_id)
        meta.loads.append(self._load_spec(req_id, state, False))

    def _load_spec(self, req_id: str, state: _Request, background: bool) -> LoadSpec:
        local, end = state.load_tokens
        state.load_tokens, state.allocated = None, False
        chunk = self.config.chunk_tokens
        n_chunks = -(-end // chunk)
        n_blocks = -(-end // self.block_size)
        self.counters.loads_planned += 1
        # each rank's worker takes over its lease with the grant and ends it once its
        # read is done, so the leased bytes outlive this request even if it is aborted
        grants, state.grants = state.grants, ()
        handed = {g.lease_id for g in grants if g is not None}
        state.lease_ids = [i for i in state.lease_ids if i not in handed]
        return LoadSpec(
            req_id,
            state.chain.keys[:n_chunks],
            state.block_ids[:n_blocks],
            local // self.block_size,
            background,
            grants,
        )

    def _plan_save(self, req_id: str, state: _Request, computed: int, out, meta) -> None:
        """Full chunks whose KV is complete after this step and not yet stored or planned.

        Only tokens vLLM already knows count: a scheduled token past them (an
        unsampled placeholder, a speculative draft) has no KV worth keeping yet.
        A request whose plan fails is not saved any more; the engine goes on.
        """
        if not self.save or state.saved < 0:
            return
        try:
            self._plan_save_chunks(req_id, state, computed, out, meta)
        except Exception as exc:
            self._log_once("plan", "kvstore: planning saves for %s failed: %r", req_id, exc)
            state.saved = -1
        self._renew_claim(state)

    def _plan_save_chunks(self, req_id: str, state: _Request, computed: int, out, meta) -> None:
        done = min(computed + out.num_scheduled_tokens.get(req_id, 0), state.chain.num_tokens)
        if not self.config.save_generated:
            done = min(done, len(state.chain.request.prompt_token_ids or []))
        keys = state.chain.extend(done)
        upto = min(done // self.config.chunk_tokens, len(state.block_ids) // self.blocks_per_chunk)
        if upto <= state.saved:
            return
        bpc = self.blocks_per_chunk
        meta.saves.append(
            SaveSpec(
                req_id,
                keys[state.saved : upto],
                keys[state.saved - 1] if state.saved else None,
                state.block_ids[state.saved * bpc : upto * bpc],
                keys[0],
            )
        )
        self.counters.chunks_planned += upto - state.saved
        state.saved = upto

    def finished(self, request) -> dict | None:
        """Forget the request; for the prefill leg of a P/D proxy, the ``kv_transfer_params``
        that tell the decode node which prompt chunks to wait for (``connector.handoff``)."""
        state = self._reqs.pop(request.request_id, None)
        self._pending.discard(request.request_id)
        if state is None:
            return None
        self._release(state)
        return self._handoff(request, state)

    def _release(self, state: _Request) -> None:
        # never waited for: vLLM frees a finished request before that step's tokens go
        # out, so a Release here would add a round trip to a one-token request's TTFT
        for lease_id in state.lease_ids:
            with contextlib.suppress(Exception):  # otherwise the lease simply expires
                self.client.release_later(lease_id)
        state.lease_ids.clear()
        state.grants = ()

    def _log_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg + " (logged once; see the connector's counters)", *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._client is not None:
            self._client.close()
