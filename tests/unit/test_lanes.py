"""kvstore.core.lanes: calls spread over threads, results in order, never stuck on a worker."""

from __future__ import annotations

import threading

import pytest

from kvstore.core import lanes

HEAVY = lanes.MIN_WEIGHT  # a weight that makes a batch worth spreading


def test_results_come_back_in_the_calls_order_whatever_lane_ran_them():
    calls = [lambda i=i: i * i for i in range(11)]
    weights = [HEAVY if i % 3 == 0 else 1 for i in range(11)]
    assert lanes.spread(calls, weights) == [i * i for i in range(11)]


def test_a_light_batch_runs_on_the_callers_thread():
    me = threading.get_ident()
    ran = lanes.spread([threading.get_ident] * 4, [1] * 4)
    assert ran == [me] * 4


@pytest.mark.skipif(lanes.LANES < 2, reason="a one-core host has one lane")
def test_a_heavy_batch_runs_on_two_threads_at_once():
    both = threading.Barrier(2, timeout=30)

    def meet() -> int:
        both.wait()  # passes only when a second thread runs the other lane meanwhile
        return threading.get_ident()

    ran = lanes.spread([meet, meet], [HEAVY, HEAVY])
    assert len(set(ran)) == 2 and threading.get_ident() in ran


@pytest.mark.skipif(lanes.LANES < 2, reason="a one-core host has one lane")
def test_busy_workers_cost_nothing_but_time_the_caller_runs_every_lane():
    release = threading.Event()
    pool = lanes._workers()
    blockers = [pool.submit(release.wait, 30) for _ in range(lanes.LANES - 1)]
    try:
        me = threading.get_ident()
        ran = lanes.spread([threading.get_ident] * 6, [HEAVY] * 6)
        assert ran == [me] * 6
    finally:
        release.set()
        for b in blockers:
            b.result(30)


def test_an_exception_in_any_lane_is_raised_after_every_lane_ended():
    ran = []

    def ok(i: int) -> int:
        ran.append(i)
        return i

    def bad() -> int:
        raise ValueError("lane failed")

    calls = [lambda: ok(0), bad, lambda: ok(2), lambda: ok(3)]
    with pytest.raises(ValueError, match="lane failed"):
        lanes.spread(calls, [HEAVY] * 4)
    # equal weights alternate: lanes [0, 2] and [1, 3]; the second stops at its failure
    assert sorted(ran) == [0, 2]
