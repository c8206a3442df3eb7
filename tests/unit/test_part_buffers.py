"""The pool a Put's parts are gathered in: buffers come back for the next chunk, within
the pool's bounds, and never while anyone still holds a view of their bytes."""

from __future__ import annotations

import numpy as np

from kvstore.server.part_buffers import ROUND, PartBuffers


def _fill(pool: PartBuffers, n: int, value: int):
    buf = pool.take(n)
    assert buf.array.nbytes == n and buf.array.dtype == np.uint8
    buf.array[:] = value
    return buf


def test_a_buffer_given_back_is_the_next_chunk_s_buffer():
    pool = PartBuffers()
    first = _fill(pool, 3 * ROUND + 5, 1)
    address = first.array.ctypes.data
    pool.give(first)
    assert first.array is None  # the lender keeps nothing
    second = pool.take(3 * ROUND)  # a smaller chunk fits the same buffer
    assert second.array.ctypes.data == address
    assert (pool.fresh, pool.reused, pool.dropped) == (1, 1, 0)
    pool.give(second)
    pool.give(second)  # twice: nothing happens
    assert pool.pooled_bytes == 4 * ROUND


def test_the_smallest_buffer_that_holds_the_chunk_is_taken():
    pool = PartBuffers()
    big, small = _fill(pool, 8 * ROUND, 1), _fill(pool, 2 * ROUND, 2)
    addresses = {big.array.ctypes.data: "big", small.array.ctypes.data: "small"}
    pool.give(big)
    pool.give(small)
    assert addresses[pool.take(ROUND).array.ctypes.data] == "small"
    assert addresses[pool.take(ROUND).array.ctypes.data] == "big"
    assert pool.take(9 * ROUND).array.nbytes == 9 * ROUND  # none holds it: a fresh one
    assert pool.fresh == 3


def test_a_buffer_someone_still_reads_is_dropped_not_overwritten():
    pool = PartBuffers()
    for keep in (memoryview, lambda a: a[10:], lambda a: np.frombuffer(memoryview(a), np.uint8)):
        buf = _fill(pool, ROUND, 7)
        kept = keep(buf.array)
        pool.give(buf)
        assert pool.pooled_bytes == 0
        other = _fill(pool, ROUND, 9)  # the next chunk gets a buffer of its own
        assert bytes(memoryview(kept)[:4]) == b"\x07" * 4
        pool.give(other)
        pool.take(ROUND)  # and empty the pool again
    assert pool.dropped == 3


def test_the_pool_keeps_no_more_than_its_bounds():
    pool = PartBuffers(max_buffers=2, max_bytes=100 * ROUND)
    bufs = [_fill(pool, 2 * ROUND, i) for i in range(3)]
    for b in bufs:
        pool.give(b)
    assert (pool.pooled_bytes, pool.dropped) == (4 * ROUND, 1)  # the third: over the count
    pool = PartBuffers(max_buffers=4, max_bytes=5 * ROUND)
    bufs = [_fill(pool, 2 * ROUND, i) for i in range(3)]
    for b in bufs:
        pool.give(b)
    assert (pool.pooled_bytes, pool.dropped) == (4 * ROUND, 1)  # the third: over the bytes
