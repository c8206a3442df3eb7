"""Spreading work that runs without the GIL (hashing, copying large buffers) over cores.

Offers ``spread(calls, weights)``: runs zero-argument calls split into lanes of about
equal weight (bytes, say), one lane on the caller's thread and the others on shared
worker threads, and returns their results in the calls' order. A lane no worker has
started by the time the caller is done with its own runs on the caller's thread too,
so a busy or missing worker (another caller's lanes queued first, a forked child)
costs at most the sequential time. Below ``MIN_WEIGHT`` in all, or on a one-core host,
everything runs on the caller's thread: a hand-off costs tens of microseconds.

On this project's two-core machine, 64 MiB in 1 MiB pieces: xxh3 2.2 -> 1.3 ms,
``np.copyto`` 3.6 -> 3.1 ms (memory-bound).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

LANES = max(1, min(4, os.cpu_count() or 1))
MIN_WEIGHT = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class _Lane:
    def __init__(self, calls: list[Callable[[], object]]) -> None:
        self.calls = calls
        self.results: list[object] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._claim = threading.Lock()

    def run(self) -> None:
        """Runs the lane unless another thread already took it."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.results = [call() for call in self.calls]
        except BaseException as exc:  # handed to the caller, raised there
            self.error = exc
        finally:
            self.done.set()


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(LANES - 1, thread_name_prefix="kvstore-lane")
        return _pool


def _forget_workers() -> None:  # a forked child has none of its parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_workers)


def spread(calls: Sequence[Callable[[], T]], weights: Sequence[int]) -> list[T]:
    """``[call() for call in calls]``, the calls spread over up to ``LANES`` threads.

    The first exception any call raised is raised here, once every lane has ended.
    """
    lanes_n = min(LANES, len(calls)) if sum(weights) >= MIN_WEIGHT else 1
    if lanes_n <= 1:
        return [call() for call in calls]
    members: list[list[int]] = [[] for _ in range(lanes_n)]
    load = [0] * lanes_n
    for i, weight in enumerate(weights):
        lightest = load.index(min(load))
        members[lightest].append(i)
        load[lightest] += weight
    lanes = [_Lane([calls[i] for i in idx]) for idx in members]
    pool = _workers()
    for lane in lanes[1:]:
        pool.submit(lane.run)
    for lane in lanes:
        lane.run()  # the caller's own lane, then any no worker has started
    for lane in lanes:
        lane.done.wait()
    for lane in lanes:
        if lane.error is not None:
            raise lane.error
    out: list[object] = [None] * len(calls)
    for idx, lane in zip(members, lanes, strict=True):
        for i, result in zip(idx, lane.results, strict=True):
            out[i] = result
    return out  # type: ignore[return-value]
