"""Whether loading a store hit pays: the measured cost of a load against this engine's
measured prefill speed.

Offers ``LoadPlanner(min_speedup)`` with ``computed(tokens, seconds)`` and
``loaded(tokens, seconds)`` (the workers' counters, as vLLM hands them to the scheduler
each step), ``worth_loading()`` (a decision, counted) and ``would_load()`` (its next
answer, not counted: the scheduler takes a lease only for a hit it will load).

A compute sample is a forward's time per token, timed by the worker from vLLM's
``bind_connector_metadata`` (just before the forward) to ``wait_for_save``, for forwards
of at least ``MIN_STEP_TOKENS`` tokens (mostly prefill) that loaded nothing
(``WorkerHalf.step_started``); on a GPU nothing is timed yet (kernels run after the
forward returns), so every hit is loaded there. A load sample is seconds per
token loaded, store call to last block written. Decisions use the
medians of the last ``SAMPLES`` of each; until there are ``MIN_SAMPLES`` of both, every hit
is loaded. A hit is skipped (computed instead) when computing it is estimated to take less
than ``min_speedup`` times as long as loading it; every ``EXPLORE_EVERY``-th skip is loaded
anyway, so that the load estimate follows the store as it gets faster or slower.

Both estimates are per token: a load's fixed costs (round trips) are spread over the
sizes of the hits actually loaded, and attention's growth with context is ignored. Decode
tokens in a timed forward make computing look slower, which only ever favours loading.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_STEP_TOKENS = 128
SAMPLES = 16
MIN_SAMPLES = 3
EXPLORE_EVERY = 8


class LoadPlanner:
    def __init__(self, min_speedup: float = 1.0) -> None:
        self.min_speedup = min_speedup
        self._compute: deque[float] = deque(maxlen=SAMPLES)  # seconds per computed token
        self._load: deque[float] = deque(maxlen=SAMPLES)  # seconds per loaded token
        self._skips = 0

    def computed(self, tokens: float, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._compute.append(seconds / tokens)

    def loaded(self, tokens: float, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._load.append(seconds / tokens)

    def estimates(self) -> tuple[float, float] | None:
        """Seconds per token (loading, computing), or None while either is unmeasured."""
        if len(self._load) < MIN_SAMPLES or len(self._compute) < MIN_SAMPLES:
            return None
        return statistics.median(self._load), statistics.median(self._compute)

    def _skips_hit(self) -> bool:
        """Both measured, and computing measured under ``min_speedup`` times loading."""
        est = self.estimates()
        return est is not None and est[1] < self.min_speedup * est[0]

    def would_load(self) -> bool:
        """What ``worth_loading`` would answer next, without counting a decision."""
        return not self._skips_hit() or (self._skips + 1) % EXPLORE_EVERY == 0

    def worth_loading(self) -> bool:
        if not self._skips_hit():
            return True
        self._skips += 1
        return self._skips % EXPLORE_EVERY == 0  # now and then load anyway: keep measuring
