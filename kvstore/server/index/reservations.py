"""Chunks in flight: single-flight prefill across nodes. No I/O, not locked (the store
calls it under its index lock).

When several engines meet the same new prefix at once, the first to look it up with
``reserve`` becomes its producer: the missing chunks are reserved for it for a bounded
time. The others see them as *pending* and wait for the producer's puts instead of
computing the same prefill. A stored chunk ends its reservation; a producer that dies
simply lets its reservation expire, and the next lookup reserves for someone else.

Offers ``Reservations(clock)`` with ``claim(keys, holder, ttl_s)`` -> ``(pending,
reserved)`` (of the keys, which lead with another holder's reservations and which
are now this holder's), ``stored(keys)`` and ``active``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence


class Reservations:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[bytes, tuple[str, float]] = {}  # key -> (holder, expiry)
        self._claims = 0

    def claim(self, keys: Sequence[bytes], holder: str, ttl_s: float) -> tuple[int, int]:
        """For the missing ``keys`` of a chain (in order): how many lead with another
        holder's live reservations (pending), and how many are reserved to ``holder``.

        A chain's missing part is either being computed by someone (pending: wait
        for it) or not (reserve it all, renewing this holder's own reservations).
        """
        now = self._clock()
        self._claims += 1
        if self._claims % 1024 == 0:
            self._prune(now)
        pending = 0
        for key in keys:
            entry = self._held.get(key)
            if entry is None or entry[1] <= now or entry[0] == holder:
                break
            pending += 1
        if pending:
            return pending, 0
        expiry = now + ttl_s
        for key in keys:
            self._held[key] = (holder, expiry)
        return 0, len(keys)

    def stored(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._held.pop(key, None)

    @property
    def active(self) -> int:
        self._prune(self._clock())
        return len(self._held)

    def _prune(self, now: float) -> None:
        for key in [k for k, (_, expiry) in self._held.items() if expiry <= now]:
            del self._held[key]
