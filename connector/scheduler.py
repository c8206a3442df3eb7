"""The scheduler half: which prefix the store can supply, and the per-step load/save plan.

Offers ``SchedulerHalf`` with ``matched_tokens(request, num_computed_tokens)``,
``after_alloc(request, num_external_tokens)``, ``build_meta(scheduler_output)``
and ``finished(request)``. It computes chunk keys from token ids with kvstore's
own key spec, asks the store with one ``Lookup`` per tensor-parallel rank
(bounded by ``lookup_timeout_s``), and never reports the whole prompt: at least
one token is always left to compute. Any store failure means "0 tokens".
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from connector.config import ConnectorConfig
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.keys import Namespace, chunk_keys, part_key

log = logging.getLogger(__name__)


@dataclass
class _Request:
    keys: list[bytes]  # every full chunk of the prompt
    stored: int = 0  # leading chunks the store holds (for every rank)
    load_tokens: tuple[int, int] | None = None  # [local computed, store hit) to load
    lease_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading chunks stored or planned for saving


class SchedulerHalf:
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
        self.lookup_failures = 0

    @property
    def client(self):
        if self._client is None:
            from kvstore.client import ClientOptions, KVStoreClient

            opts = ClientOptions(timeout_s=self.config.lookup_timeout_s, retries=0)
            self._client = KVStoreClient(self.config.store, opts)
        return self._client

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that the store can supply (whole chunks)."""
        old = self._reqs.pop(request.request_id, None)
        if old is not None:
            self._release(old)
        tokens = list(request.prompt_token_ids or [])
        state = _Request(chunk_keys(self.ns, tokens, self.config.chunk_tokens))
        self._reqs[request.request_id] = state
        usable = (len(tokens) - 1) // self.config.chunk_tokens  # leave one token to compute
        if not self.load or usable == 0:
            return 0
        state.stored = self._lookup(state, state.keys[:usable])
        state.saved = state.stored
        hit = state.stored * self.config.chunk_tokens
        if hit <= num_computed_tokens:
            self._release(state)
            return 0
        state.load_tokens = (num_computed_tokens, hit)
        return hit - num_computed_tokens

    def _lookup(self, state: _Request, keys: list[bytes]) -> int:
        """Chunks every rank's part of which is stored; leases them meanwhile."""
        matched = len(keys)
        try:
            for rank in range(self.tp):
                parts = [part_key(k, rank, self.tp) for k in keys[:matched]]
                res = self.client.lookup(parts, lease_ttl_s=self.config.lease_ttl_s)
                if res.lease_id:
                    state.lease_ids.append(res.lease_id)
                matched = min(matched, res.matched)
                if matched == 0:
                    break
        except Exception as exc:  # a store that is down or slow must never stop the engine
            self.lookup_failures += 1
            log.warning("kvstore lookup failed, computing instead: %s", exc)
            return 0
        return matched

    def after_alloc(self, request, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None and num_external_tokens == 0:
            state.load_tokens = None

    def build_meta(self, out) -> KVStoreMetadata:
        meta = KVStoreMetadata()
        for new in out.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load_tokens is not None:
                local, hit = state.load_tokens
                n = hit // self.config.chunk_tokens
                meta.loads.append(
                    LoadSpec(
                        new.req_id,
                        state.keys[:n],
                        state.block_ids[: n * self.blocks_per_chunk],
                        local // self.block_size,
                    )
                )
                state.load_tokens = None
            self._plan_save(new.req_id, state, new.num_computed_tokens, out, meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_blocks[0])
                else:
                    state.block_ids.extend(new_blocks[0])
            self._plan_save(req_id, state, cached.num_computed_tokens[i], out, meta)
        return meta

    def _plan_save(self, req_id: str, state: _Request, computed: int, out, meta) -> None:
        """Chunks of the prompt whose KV is complete after this step and not yet stored."""
        if not self.save:
            return
        done = computed + out.num_scheduled_tokens.get(req_id, 0)
        upto = min(done // self.config.chunk_tokens, len(state.keys))
        upto = min(upto, len(state.block_ids) // self.blocks_per_chunk)
        if upto <= state.saved:
            return
        bpc = self.blocks_per_chunk
        meta.saves.append(
            SaveSpec(
                req_id,
                state.keys[state.saved : upto],
                state.keys[state.saved - 1] if state.saved else None,
                state.block_ids[state.saved * bpc : upto * bpc],
            )
        )
        state.saved = upto

    def finished(self, request) -> None:
        state = self._reqs.pop(request.request_id, None)
        if state is not None:
            self._release(state)

    def _release(self, state: _Request) -> None:
        for lease_id in state.lease_ids:
            with contextlib.suppress(Exception):  # otherwise the lease simply expires
                self.client.release(lease_id)
        state.lease_ids.clear()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
