"""Single-flight prefill bookkeeping: the first engine to look up a new prefix with a
reservation becomes its producer, the others see it pending until its puts land or its
reservation lapses. Against the real store (real shared memory, real LMDB)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvstore.server.index.reservations import Reservations
from tests.chunks import chain, keys_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_reserves_the_others_wait_and_a_put_ends_the_wait(open_store):
    clock = Clock()
    store = open_store(clock=clock)
    records = chain(4, seed=1)
    keys = keys_of(records)
    first = store.lookup(keys, reserve=("node-a", 30))
    assert (first.matched, first.pending, first.reserved) == (0, 0, 4)
    second = store.lookup(keys, reserve=("node-b", 30))
    assert (second.matched, second.pending, second.reserved) == (0, 4, 0)
    assert store.stats().reservations == 4
    store.put(records[:2])  # the producer's first chunks land
    third = store.lookup(keys, reserve=("node-b", 30))
    assert (third.matched, third.pending, third.reserved) == (2, 2, 0)
    store.put(records[2:])
    done = store.lookup(keys, reserve=("node-b", 30))
    assert (done.matched, done.pending, done.reserved) == (4, 0, 0)
    assert store.stats().reservations == 0


def test_a_producer_that_dies_lets_its_reservation_lapse(open_store):
    clock = Clock()
    store = open_store(clock=clock)
    keys = keys_of(chain(3, seed=2))
    assert store.lookup(keys, reserve=("node-a", 5)).reserved == 3
    assert store.lookup(keys, reserve=("node-b", 5)).pending == 3
    clock.now += 5.01  # node-a never put anything
    took_over = store.lookup(keys, reserve=("node-b", 5))
    assert (took_over.pending, took_over.reserved) == (0, 3)
    assert store.lookup(keys, reserve=("node-a", 5)).pending == 3  # now a waits for b


def test_a_producer_renews_its_own_reservation_and_plain_lookups_reserve_nothing(open_store):
    clock = Clock()
    store = open_store(clock=clock)
    keys = keys_of(chain(2, seed=3))
    assert store.lookup(keys).reserved == 0 and store.stats().reservations == 0
    assert store.lookup(keys, reserve=("node-a", 5)).reserved == 2
    clock.now += 4
    assert store.lookup(keys, reserve=("node-a", 5)).reserved == 2  # renewed
    clock.now += 4
    assert store.lookup(keys, reserve=("node-b", 5)).pending == 2  # still a's


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.floats(0, 3)), max_size=30
    )
)
def test_a_key_is_never_reserved_to_two_live_holders(steps):
    clock = Clock()
    table = Reservations(clock)
    keys = [bytes([i]) * 16 for i in range(6)]
    for holder, start, advance in steps:
        clock.now += advance
        pending, reserved = table.claim(keys[start:], holder, 2.0)
        assert pending == 0 or reserved == 0
        live = {k: h for k, (h, exp) in table._held.items() if exp > clock.now}
        if reserved:
            assert all(live[k] == holder for k in keys[start:])
        if pending:
            assert live[keys[start]] != holder
