"""The radix index on its own: scenarios, then invariants under random operations."""

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.core.types import InvalidArgument, NotFound
from kvstore.server.index import RadixIndex, TierSpec
from kvstore.server.index.node import Node, RecencyList

NS = b"n" * 32


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def admit(index: RadixIndex, k: bytes, parent: bytes | None, size: int) -> bool:
    """What the store does for a new chunk: make room in the top tier, then add."""
    plan = index.plan_eviction(0, index.tiers[0].cost(size), keep=[parent] if parent else ())
    if plan is None:
        return False
    for step in plan.steps:
        index.apply(step)
    index.add(k, parent, NS, size, 0)
    return True


def chain(index, n, start=0, size=10):
    for i in range(start, start + n):
        assert admit(index, key(i), key(i - 1) if i > start else None, size)
    return [key(i) for i in range(start, start + n)]


def test_match_returns_the_longest_present_prefix():
    index = RadixIndex([TierSpec("dram", 1000)])
    keys = chain(index, 4)
    assert [n.key for n in index.match(keys + [key(99)])] == keys
    assert index.match([key(1)]) == []  # a suffix alone is not a prefix
    assert index.match([]) == []


def test_a_chunk_whose_parent_is_unknown_is_refused():
    index = RadixIndex([TierSpec("dram", 1000)])
    with pytest.raises(NotFound, match="parent"):
        index.add(key(2), key(1), NS, 10, 0)
    assert len(index) == 0


def test_same_key_under_another_parent_is_refused():
    index = RadixIndex([TierSpec("dram", 1000)])
    chain(index, 2)
    admit(index, key(7), None, 10)
    with pytest.raises(InvalidArgument):
        index.add(key(1), key(7), NS, 10, 0)


def test_upper_tier_evicts_by_demotion_oldest_first():
    index = RadixIndex(
        [TierSpec("dram", 100), TierSpec("nvme", 1000)], high_watermark=1.0, low_watermark=0.6
    )
    a = chain(index, 5, start=0)
    b = chain(index, 5, start=100)
    index.touch(index.match(a))  # a is now the most recent
    assert admit(index, key(200), None, 10)
    # b went down to nvme, a stayed in dram; nothing was lost
    assert all(index.get(k).in_tier(1) and not index.get(k).in_tier(0) for k in b[:4])
    assert all(index.get(k).in_tier(0) for k in a)
    assert len(index) == 11
    assert index.used[0] == 60


def test_last_tier_drops_leaves_only_and_keeps_prefixes():
    index = RadixIndex([TierSpec("dram", 100)], high_watermark=1.0, low_watermark=0.6)
    a = chain(index, 10)
    assert admit(index, key(50), None, 10)
    survivors = [n.key for n in index.match(a)]
    assert survivors == a[: len(survivors)]  # the tail went, the head stayed
    assert len(survivors) == 5
    assert index.why_missing(a[-1])[0] == "dram"


def test_leased_chunks_are_not_evicted_and_leases_expire():
    clock = Clock()
    index = RadixIndex([TierSpec("dram", 100)], high_watermark=1.0, low_watermark=0.5, clock=clock)
    a = chain(index, 10)
    lease = index.lease(index.match(a), ttl_s=5)
    assert index.plan_eviction(0, 10) is None  # every chunk is leased
    assert not admit(index, key(50), None, 10)
    assert len(index) == 10
    clock.now = 6
    assert admit(index, key(50), None, 10)
    with pytest.raises(NotFound, match="expired"):
        index.release(lease)


def test_release_frees_the_lease():
    index = RadixIndex([TierSpec("dram", 100)], high_watermark=1.0, low_watermark=0.5)
    a = chain(index, 10)
    lease = index.lease(index.match(a), ttl_s=60)
    index.release(lease)
    assert admit(index, key(50), None, 10)
    with pytest.raises(NotFound):
        index.release(lease)


def test_demotion_copies_missing_ancestors_to_keep_the_last_tier_closed():
    index = RadixIndex([TierSpec("dram", 50), TierSpec("nvme", 1000)], low_watermark=0.8)
    a = chain(index, 3)
    # make the child older than its parents so it is evicted first
    index.touch(index.match(a[:2]))
    plan = index.plan_eviction(0, 20)
    moved = [(s.node.key, s.keep_src) for s in plan.steps]
    assert moved[:3] == [(a[0], True), (a[1], True), (a[2], False)]
    for step in plan.steps:
        index.apply(step)
    assert all(index.get(k).in_tier(1) for k in a)


def test_delete_removes_the_suffix_too():
    index = RadixIndex([TierSpec("dram", 1000)])
    a = chain(index, 5)
    removed = index.delete([a[2]])
    assert {n.key for n, _ in removed} == set(a[2:])
    assert [n.key for n in index.match(a)] == a[:2]
    assert index.used[0] == 20


def test_delete_namespace():
    index = RadixIndex([TierSpec("dram", 1000)])
    chain(index, 3)
    index.add(key(9), None, b"o" * 32, 10, 0)
    assert len(index.delete_namespace(NS)) == 3
    assert list(index.namespaces()) == [b"o" * 32]


def test_tiers_charge_what_their_cost_function_says():
    index = RadixIndex([TierSpec("dram", 1000, cost_of=lambda n: -(-n // 100) * 100)])
    chain(index, 3, size=7)
    assert index.used[0] == 300


def test_fifo_policy_ignores_reads():
    index = RadixIndex([TierSpec("dram", 100)], policy="fifo", low_watermark=0.9)
    chain(index, 1, start=0)
    chain(index, 9, start=10)
    index.touch(index.match([key(0)]))
    assert admit(index, key(99), None, 10)
    assert index.get(key(0)) is None  # read recently, stored first: gone under FIFO


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 12),
    moves=st.lists(st.lists(st.integers(0, 11), unique=True, max_size=12).map(sorted), max_size=12),
    tier=st.integers(0, 2),
    shuffle=st.randoms(use_true_random=False),
)
def test_move_to_newest_matches_a_plain_list(size, moves, tier, shuffle):
    """Runs spliced whole (the fast path) must leave the order a node-by-node move would."""
    nodes = [Node(bytes([i]) * 16, None, NS, 1) for i in range(size)]
    lst, model = RecencyList(tier), list(range(size))
    shuffle.shuffle(model)
    for i in model:
        lst.push_newest(nodes[i])
    for move in moves:
        # seq in list order or not: callers pass a chain, which need not be one run
        seq = [i for i in move if i < size]
        if shuffle.random() < 0.5:
            seq = [i for i in model if i in seq]
        lst.move_to_newest([nodes[i] for i in seq])
        model = [i for i in model if i not in seq] + seq
        assert [n.key[0] for n in lst.oldest_first()] == model
    newest_first = []
    node = getattr(lst.head, f"p{tier}")
    while node is not lst.head:  # the backward links agree with the forward ones
        newest_first.append(node.key[0])
        node = getattr(node, f"p{tier}")
    assert newest_first == model[::-1]
    assert lst.count == size


# ---- random operation sequences -------------------------------------------------


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        ntiers=st.integers(1, 3),
        caps=st.lists(st.integers(2, 8), min_size=3, max_size=3),
        low=st.sampled_from([0.5, 0.8, 1.0]),
    )
    def setup(self, ntiers, caps, low):
        self.clock = Clock()
        specs = [TierSpec(f"t{i}", caps[i] * 10) for i in range(ntiers)]
        self.index = RadixIndex(specs, high_watermark=1.0, low_watermark=low, clock=self.clock)
        self.next_key = 1
        self.leases: dict[int, tuple[float, list[bytes]]] = {}
        self.deleted: set[bytes] = set()

    def snapshot(self):
        return (
            list(self.index.used),
            list(self.index.counts),
            {n.key: n.tiers for n in self.index.nodes()},
        )

    @rule(data=st.data(), size=st.sampled_from([10, 10, 20]))
    def put(self, data, size):
        nodes = list(self.index.nodes())
        parent = None
        if nodes and data.draw(st.booleans()):
            parent = data.draw(st.sampled_from(nodes)).key
        k = key(self.next_key)
        self.next_key += 1
        before = self.snapshot()
        if admit(self.index, k, parent, size):
            event("put admitted")
        else:
            event("put refused")
            assert self.snapshot() == before

    @rule(n=st.integers(2, 6))
    def put_chain(self, n):
        parent = None
        for _ in range(n):
            k = key(self.next_key)
            self.next_key += 1
            before = self.snapshot()
            if not admit(self.index, k, parent, 10):
                assert self.snapshot() == before
                return
            parent = k

    @rule(data=st.data(), ttl=st.sampled_from([1.0, 5.0]))
    def lease_a_chain(self, data, ttl):
        nodes = list(self.index.nodes())
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        path = []
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        assert self.index.match([n.key for n in path]) == path
        self.index.touch(path)
        lease = self.index.lease(path, ttl)
        self.leases[lease] = (self.clock.now + ttl, [n.key for n in path])

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = data.draw(st.sampled_from(sorted(self.leases)))
        expiry, _ = self.leases.pop(lease)
        if expiry > self.clock.now:
            self.index.release(lease)

    @rule(dt=st.sampled_from([0.5, 2.0]))
    def tick(self, dt):
        self.clock.now += dt

    @rule(data=st.data(), incoming=st.integers(0, 60))
    def evict(self, data, incoming):
        tier = data.draw(st.integers(0, len(self.index.tiers) - 1))
        before = self.snapshot()
        plan = self.index.plan_eviction(tier, incoming)
        assert self.snapshot() == before  # planning alone changes nothing
        if plan is None:
            event("eviction impossible")
            return
        event(f"eviction of {min(len(plan.steps), 3)}+ steps over {len(plan.freed)} tiers")
        event("closure copy" if any(s.keep_src for s in plan.steps) else "no closure copy")
        for step in plan.steps:
            self.index.apply(step)
        cap = self.index.tiers[tier].capacity_bytes
        assert self.index.used[tier] + incoming <= cap or incoming > cap

    @rule(data=st.data())
    def delete(self, data):
        nodes = list(self.index.nodes())
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.deleted |= {n.key for n, _ in self.index.delete([node.key])}

    @invariant()
    def parents_are_in_the_tree(self):
        for node in self.index.nodes():
            assert node.tiers != 0
            if node.parent is not None:
                assert self.index.get(node.parent.key) is node.parent

    @invariant()
    def last_tier_is_prefix_closed(self):
        last = self.index.last
        for node in self.index.nodes():
            if node.in_tier(last) and node.parent is not None:
                assert node.parent.in_tier(last)

    @invariant()
    def accounting_matches_and_capacity_holds(self):
        for t, spec in enumerate(self.index.tiers):
            members = [n for n in self.index.nodes() if n.in_tier(t)]
            assert self.index.used[t] == sum(spec.cost(n.size) for n in members)
            assert self.index.counts[t] == len(members)
            assert self.index.used[t] <= spec.capacity_bytes

    @invariant()
    def leased_chunks_are_never_evicted(self):
        for expiry, keys in self.leases.values():
            if expiry > self.clock.now:
                for k in keys:
                    assert k in self.deleted or self.index.get(k) is not None


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestIndexMachine = IndexMachine.TestCase
