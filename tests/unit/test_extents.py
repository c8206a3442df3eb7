"""The extent allocator under random reserve/commit/abort/remove sequences: free and used
bytes always add up to the capacity, no two chunks share a byte, free space is always
merged, and any chunk fits whenever the free bytes suffice."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.core.types import TierFullError
from kvstore.server.tiers.extents import ALIGN, ExtentTable

CAPACITY = 64 * ALIGN


class ExtentMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = ExtentTable("t", CAPACITY)
        self.held: dict[bytes, int] = {}  # committed key -> cost
        self.next = 0

    @rule(size=st.integers(0, 20 * ALIGN), commit=st.booleans())
    def reserve(self, size, commit):
        key = self.next.to_bytes(16, "little")
        self.next += 1
        need = ExtentTable.cost(size)
        free = self.table.free_bytes
        try:
            alloc = self.table.reserve(key, size)
        except TierFullError:
            assert need > free  # refused only when the bytes really are not there
            return
        assert need <= free and alloc is not None
        assert sum(n for _, n in alloc.pieces) == need
        assert sum(n for _, n in alloc.payload_spans()) == size
        if commit:
            self.table.commit(alloc)
            self.held[key] = need
        else:
            self.table.abort(alloc)

    @rule(data=st.data())
    def remove(self, data):
        if not self.held:
            return
        key = data.draw(st.sampled_from(sorted(self.held)))
        self.table.remove([key])
        del self.held[key]

    @rule()
    def restore_a_stored_key(self):
        if self.held:
            key = min(self.held)
            assert self.table.reserve(key, 1) is None  # stored keys keep their bytes

    @invariant()
    def bytes_add_up_and_nothing_overlaps(self):
        assert self.table.free_bytes + sum(self.held.values()) == CAPACITY
        spans = sorted(p for k in self.held for p in self.table.lookup(k).pieces)
        spans += sorted(self.table._by_start.items())
        spans.sort()
        end = 0
        for start, n in spans:
            assert start >= end and n > 0 and start % ALIGN == 0
            end = start + n
        assert end <= CAPACITY

    @invariant()
    def free_space_is_merged(self):
        free = sorted(self.table._by_start.items())
        for (a, n), (b, _) in zip(free, free[1:]):
            assert a + n < b  # two touching free extents would have been merged


ExtentMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestExtentTable = ExtentMachine.TestCase
