"""What the scheduler half does with other nodes: wait for chunks another node is
computing, keep its own single-flight claims alive while it computes, and hand a P/D
decode node the chunks it saved. A mixin of ``SchedulerHalf`` (as the store's read paths
are of ``TieredStore``): it uses the half's config, counters, client and request state.

Offers ``_keep_waiting`` (``connector.waits``: bounded by ``wait_timeout_s``; a store that
fails ends the wait), ``_renew_claim`` and ``_handoff`` (``connector.handoff``). Never
raises into the engine: a failed renewal only lets the claim lapse.
"""

from __future__ import annotations

import logging
import time

from connector.handoff import expected_chunks, handoff_params, is_handoff, wants_handoff
from connector.waits import Wait
from kvstore.core.keys import part_key

log = logging.getLogger("connector.scheduler")


class NodeCoordination:
    def _keep_waiting(self, state, request, keys, pending: int, ok: bool) -> bool:
        """Whether the request should wait (``connector.waits``) for chunks another node is
        computing: those a prefill node said it saved, or those another engine reserved."""
        if state.waited:
            return False
        now = time.monotonic()
        if state.wait is None:
            params = getattr(request, "kv_transfer_params", None)
            target, why = expected_chunks(params, self.ns, keys)
            if why:
                self._log_once("handoff", "kvstore: ignoring P/D params: %s", why)
            timeout = self.config.wait_timeout_s
            state.wait = Wait.begin(target, state.stored, pending, ok, timeout, now)
            if state.wait is None:
                return False
            self.counters.waits += 1
        outcome = state.wait.step(state.stored, pending, ok, now)
        if outcome == "wait":
            return True
        if outcome == "gave_up":
            self.counters.wait_timeouts += 1
            log.info(
                "kvstore: %s stopped waiting for another node's chunks (%d of %d stored, "
                "%d pending): computing the rest",
                request.request_id,
                state.stored,
                state.wait.target,
                pending,
            )
        state.wait, state.waited = None, True
        return False

    @staticmethod
    def _is_handoff(request) -> bool:
        """The decode leg of a P/D proxy: its prompt's chunks come from the prefill node."""
        return is_handoff(getattr(request, "kv_transfer_params", None))

    def _renew_claim(self, state) -> None:
        """A producer still computing the prompt chunks it reserved renews the claim every
        half ``reserve_ttl_s``, so that only a dead producer's claim lapses, not a slow one's
        (a prefill longer than the TTL would otherwise let a waiter compute the rest too)."""
        if state.claimed_at is None or time.monotonic() - state.claimed_at < (
            self.config.reserve_ttl_s / 2
        ):
            return
        prompt_chunks = len(state.chain.request.prompt_token_ids or []) // self.config.chunk_tokens
        if not 0 <= state.saved < prompt_chunks:
            state.claimed_at = None  # all planned (the last claim outlives their sends) or given up
            return
        state.claimed_at = time.monotonic()
        keys = [part_key(k, 0, self.tp) for k in state.chain.keys[:prompt_chunks]]
        try:
            self.client.lookup(
                keys, lease_ttl_s=0.0, reserve_ttl_s=self.config.reserve_ttl_s, holder=self.holder
            )
        except Exception as exc:  # the claim lapses; waiters compute, nothing breaks
            self._log_once("renew", "kvstore: renewing a reservation failed: %s", exc)

    def _handoff(self, request, state) -> dict | None:
        """For the prefill leg of a P/D proxy: the ``kv_transfer_params`` that tell the
        decode node which prompt chunks to wait for."""
        if not (self.save and state.saved > 0):
            return None
        if not wants_handoff(getattr(request, "kv_transfer_params", None)):
            return None
        prompt_chunks = len(request.prompt_token_ids or []) // self.config.chunk_tokens
        params = handoff_params(self.ns, state.chain.keys, min(state.saved, prompt_chunks))
        self.counters.handoffs += params is not None
        return params
