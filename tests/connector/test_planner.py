"""The load planner: measured load cost per token against measured compute time per token."""

from __future__ import annotations

import torch

from connector.plan import KVStoreMetadata, LoadSpec
from connector.planner import EXPLORE_EVERY, MIN_SAMPLES, MIN_STEP_TOKENS, LoadPlanner


def measured(planner: LoadPlanner, compute_s: float, load_s: float, n: int = 4) -> LoadPlanner:
    """``n`` samples of each, in seconds per token."""
    for _ in range(n):
        planner.computed(512, 512 * compute_s)
        planner.loaded(256, 256 * load_s)
    return planner


def test_every_hit_loads_until_both_speeds_are_measured():
    planner = LoadPlanner()
    for _ in range(MIN_SAMPLES):
        planner.computed(1000, 0.001)  # 1 us per token: cheap
    for _ in range(MIN_SAMPLES - 1):
        planner.loaded(1000, 1.0)  # 1 ms per token: far slower
        assert planner.worth_loading()
    assert planner.estimates() is None
    planner.loaded(1000, 1.0)
    load_s, compute_s = planner.estimates()
    assert load_s == 1e-3 and abs(compute_s - 1e-6) < 1e-12
    assert not planner.worth_loading()


def test_a_hit_loads_when_loading_is_faster_and_not_when_it_is_slower():
    fast_store = measured(LoadPlanner(), compute_s=1e-3, load_s=1e-4)
    assert all(fast_store.worth_loading() for _ in range(20))
    demanding = measured(LoadPlanner(min_speedup=20.0), compute_s=1e-3, load_s=1e-4)
    assert not demanding.worth_loading()  # wants 20x, measures 10x


def test_decisions_follow_the_median_of_recent_samples():
    planner = measured(LoadPlanner(), compute_s=1e-3, load_s=1e-4)
    planner.loaded(256, 256.0)  # one very slow load (a stall) does not flip the decision
    assert planner.worth_loading()
    for _ in range(16):  # the store got slow for good
        planner.loaded(256, 256 * 1e-2)
    assert not planner.worth_loading()


def test_every_eighth_skip_loads_anyway_to_keep_measuring():
    planner = measured(LoadPlanner(), compute_s=1e-6, load_s=1e-3)
    answers = [planner.worth_loading() for _ in range(3 * EXPLORE_EVERY)]
    loaded = [i for i, a in enumerate(answers) if a]
    assert loaded == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1]


def test_would_load_foretells_the_next_decision_without_counting_it():
    for planner in (
        LoadPlanner(),  # unmeasured
        measured(LoadPlanner(), compute_s=1e-3, load_s=1e-4),  # loads
        measured(LoadPlanner(), compute_s=1e-6, load_s=1e-3),  # skips, explores
    ):
        for _ in range(2 * EXPLORE_EVERY + 3):
            foretold = planner.would_load()
            assert planner.would_load() == foretold  # asking twice changes nothing
            assert planner.worth_loading() == foretold


def test_empty_counters_are_no_samples():
    planner = LoadPlanner()
    for _ in range(MIN_SAMPLES):
        planner.computed(0, 1.0)
        planner.loaded(100, 0.0)
        planner.loaded(0, 1.0)
    assert planner.estimates() is None


class _Worker:
    """Just what ``WorkerHalf.step_started``/``step_ended`` touch."""

    def __init__(self, device_cache: torch.Tensor) -> None:
        from connector.worker import WorkerCounters

        self._layers = [device_cache]
        self.counters = WorkerCounters()
        self._step = None

    def _count(self, name: str, n) -> None:
        setattr(self.counters, name, getattr(self.counters, name) + n)


def test_the_worker_times_prefill_forwards_without_loads_only():
    from connector.worker import WorkerHalf

    w = _Worker(torch.zeros(1))
    spec = LoadSpec("r", [b"k"], [0], 0)
    for meta in (
        KVStoreMetadata(scheduled_tokens=MIN_STEP_TOKENS),  # timed
        KVStoreMetadata(scheduled_tokens=MIN_STEP_TOKENS - 1),  # decode-sized
        KVStoreMetadata(loads=[spec], scheduled_tokens=4 * MIN_STEP_TOKENS),  # loads
    ):
        WorkerHalf.step_started(w, meta)
        WorkerHalf.step_ended(w)
    assert w.counters.timed_tokens == MIN_STEP_TOKENS
    assert w.counters.timed_seconds > 0
