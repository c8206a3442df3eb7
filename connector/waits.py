"""A request waiting for chunks another node is computing: a P/D prefill node's saves
(``connector.handoff``) or another engine's single-flight reservation. Pure: no I/O.

Offers ``Wait.begin(target, stored, pending, ok, timeout_s, now)`` (a wait, or None when
there is nothing to wait for) and ``wait.step(stored, pending, ok, now)`` ->
``"wait"`` (poll again after ``next_poll``), ``"arrived"`` or ``"gave_up"``. A wait
never outlives its deadline, and a store that fails ends it at once.
"""

from __future__ import annotations

from dataclasses import dataclass

POLL_S = 0.01  # between two lookups of a waiting request


@dataclass
class Wait:
    target: int  # leading chunks a prefill node said it saved (0: none named)
    until: float  # give up and compute (monotonic)
    next_poll: float = 0.0

    @classmethod
    def begin(
        cls, target: int, stored: int, pending: int, ok: bool, timeout_s: float, now: float
    ) -> Wait | None:
        if not ok or (stored >= target and not pending):
            return None
        return cls(target, now + timeout_s)

    def step(self, stored: int, pending: int, ok: bool, now: float) -> str:
        if stored >= self.target and not pending:
            return "arrived"
        if not ok or now >= self.until:
            return "gave_up"
        self.next_poll = now + POLL_S
        return "wait"
