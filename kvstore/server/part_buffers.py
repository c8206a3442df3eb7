"""Buffers that gather a chunk's payload from its parts, reused from one chunk to the next.

Offers ``small_pages(n)``, fresh anonymous memory in 4 KiB pages, and ``PartBuffers``, a
bounded pool of such buffers: ``take(n)`` lends a ``PartBuffer`` whose ``array`` is ``n``
bytes, ``give(buf)`` takes it back once the put is done with it.

A fresh buffer for every chunk costs the store's process a page fault for each of its
4 KiB pages (8,192 for a 32 MiB chunk) and a ``munmap`` when it is dropped. Both take the
process's memory-map lock and the ``munmap`` interrupts every core running one of its
threads to flush their address caches, so every thread of the store, lookups included,
feels each chunk's buffer come and go. A buffer that is reused was faulted in once. Under
a stream of 64 MiB puts in 1 MiB parts, paired probe runs here: the store's minor faults
per MiB put 268-425 -> 4-26 and the stream 5-10 % faster; the lookups' p99 5.74 -> 5.52 ms,
within the rounds' spread (``benchmarks/README.md``).

The pool keeps at most ``MAX_BUFFERS`` buffers and ``MAX_BYTES`` in all (the rest are
dropped as before); an idle store holds them. A buffer is reused only when nothing but
the pool still refers to it: an array that some reader kept a view of (a traceback, a
tier that held on to a payload) is dropped, never overwritten.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import sys
import threading

import numpy as np

MAX_BUFFERS = 4
MAX_BYTES = 160 << 20  # four Llama-3-8B bf16 256-token chunks (32 MiB and a header)
ROUND = 1 << 20  # buffers are sized in whole MiB so that nearby sizes share them


def small_pages(n: int) -> np.ndarray:
    """``n`` bytes of fresh anonymous memory in 4 KiB pages (unzeroed by us: the kernel
    hands out zero pages as they are first written).

    numpy asks for transparent huge pages on a large array, and with the kernel's default
    ``defrag`` (``madvise``) each 2 MiB fault may compact memory on the spot, whose page
    moves stop every thread of the store (TLB shootdowns); lookups under a stream of
    32 MiB chunks showed it (p99 5.5-5.8 ms, 4.3-4.4 ms without huge pages).
    """
    region = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP on this kernel: nothing to do
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, np.uint8, count=n)  # the array keeps the mapping alive


def _refs(array: np.ndarray, whole: np.ndarray) -> tuple[int, int]:
    return sys.getrefcount(array), sys.getrefcount(whole)


def _unshared() -> tuple[int, int]:
    """``_refs`` of an array and its whole buffer that only locals refer to, as in
    ``give``. Measured rather than assumed: what a count includes varies between Python
    versions (3.14 no longer counts a local passed as an argument)."""
    whole = np.empty(16, np.uint8)
    array = whole[:1]
    return _refs(array, whole)


_UNSHARED = _unshared()


class PartBuffer:
    """One buffer lent by ``PartBuffers.take``: ``array`` holds exactly the bytes asked for."""

    __slots__ = ("array", "_whole")

    def __init__(self, array: np.ndarray, whole: np.ndarray) -> None:
        self.array, self._whole = array, whole


class PartBuffers:
    """A bounded pool of part buffers; thread-safe."""

    def __init__(self, max_buffers: int = MAX_BUFFERS, max_bytes: int = MAX_BYTES) -> None:
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, np.ndarray]] = []  # (capacity, id, buffer), sorted
        self.reused = self.fresh = self.dropped = 0

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(cap for cap, _, _ in self._free)

    def take(self, n: int) -> PartBuffer:
        """``n`` bytes: the smallest pooled buffer that holds them, else a fresh one."""
        with self._lock:
            i = bisect.bisect_left(self._free, (n,))
            whole = self._free.pop(i)[2] if i < len(self._free) else None
            self.reused += whole is not None
            self.fresh += whole is None
        if whole is None:
            whole = small_pages(-(-max(n, 1) // ROUND) * ROUND)
        return PartBuffer(whole[:n], whole)

    def give(self, buf: PartBuffer) -> None:
        """Take back a buffer once its put is done: kept for the next chunk if nothing else
        refers to its bytes and the pool has room, dropped otherwise. ``buf`` is empty after."""
        array, whole = buf.array, buf._whole
        buf.array = buf._whole = None
        if array is None:
            return  # given back already
        # More references than a buffer nobody else holds has (measured the same way at
        # import): a view or memoryview someone kept of the bytes.
        if _refs(array, whole) != _UNSHARED:
            with self._lock:
                self.dropped += 1
            return
        del array
        with self._lock:
            total = sum(cap for cap, _, _ in self._free) + whole.nbytes
            if len(self._free) >= self.max_buffers or total > self.max_bytes:
                self.dropped += 1
                return
            bisect.insort(self._free, (whole.nbytes, id(whole), whole))
