"""Bookkeeping for a memory region shared by chunks of any size (dram and hbm tiers).

No I/O: it only decides which bytes of the region hold which key. Offers
``ExtentTable`` with ``cost(nbytes)``, ``reserve(key, nbytes)`` (an ``Allocation``
or ``TierFullError``), ``commit(alloc)``, ``abort(alloc)``, ``lookup(key)``,
``remove(keys)``, ``detach(key)`` and ``free_bytes``; and ``ExtentTierOps``, the
table-only methods both memory tiers share.

Layout: every chunk takes ``KEY_BYTES`` for its key, then its payload, rounded
up to ``ALIGN``. A chunk is placed in the smallest free extent that holds it
(best fit); only when no single free extent is large enough is it split over
several (largest first; every piece is a multiple of ``ALIGN``, so the key
never straddles two), so any chunk fits whenever the free bytes suffice and
the index's byte accounting is exact. Only the first piece carries the key. A
single-piece chunk has one contiguous payload, which same-host readers copy
straight out of shared memory; a split chunk is read by copying its pieces.

A write reserves, copies its bytes, then commits, so a lookup never finds a key
whose bytes are half written. A key that is already stored keeps its bytes: a
chunk's key names its content, and readers may hold its extents under a lease.

Thread-safe: one short lock around the free list and the key map, never held
while bytes are copied.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.core.types import KEY_BYTES, ChunkKey, InvalidArgument, TierFullError
from kvstore.server.tiers.base import StoredChunk

ALIGN = 512


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where one chunk lives: ``pieces`` of ``(offset, length)``; the key opens the first."""

    key: ChunkKey
    length: int  # payload bytes
    pieces: tuple[tuple[int, int], ...]

    @property
    def contiguous(self) -> bool:
        return len(self.pieces) == 1

    @property
    def payload_offset(self) -> int:
        return self.pieces[0][0] + KEY_BYTES

    def payload_spans(self) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` of each run of payload bytes, in order."""
        left = self.length
        for i, (off, size) in enumerate(self.pieces):
            start = off + KEY_BYTES if i == 0 else off
            n = min(left, off + size - start)
            if n > 0:
                yield start, n
                left -= n


class ExtentTable:
    def __init__(self, tier: str, capacity_bytes: int) -> None:
        capacity = capacity_bytes // ALIGN * ALIGN
        if capacity < ALIGN:
            raise InvalidArgument(f"{tier}: capacity must be at least {ALIGN} B")
        self.tier = tier
        self.capacity_bytes = capacity
        self._lock = threading.Lock()
        self._by_start: dict[int, int] = {0: capacity}  # free extents: start -> length
        self._by_end: dict[int, int] = {capacity: 0}  # free extents: end -> start
        self._sizes: list[tuple[int, int]] = [(capacity, 0)]  # sorted (length, start)
        self._free = capacity
        self._where: dict[ChunkKey, Allocation] = {}

    @staticmethod
    def cost(nbytes: int) -> int:
        """Region bytes one payload of ``nbytes`` occupies."""
        return _round_up(KEY_BYTES + nbytes)

    @property
    def free_bytes(self) -> int:
        return self._free

    def reserve(self, key: ChunkKey, nbytes: int) -> Allocation | None:
        """Room for one payload, or None if ``key`` is stored already; ``TierFullError``."""
        need = self.cost(nbytes)
        if need > self.capacity_bytes:
            raise InvalidArgument(
                f"{self.tier}: a chunk of {nbytes} B is larger than the whole tier "
                f"({self.capacity_bytes} B)"
            )
        with self._lock:
            if key in self._where:
                return None
            if need > self._free:
                raise TierFullError(
                    f"{self.tier} tier full: a chunk needs {need} B, {self._free} B of "
                    f"{self.capacity_bytes} free"
                )
            i = bisect.bisect_left(self._sizes, (need, -1))
            if i < len(self._sizes):
                pieces = [self._take(*self._sizes[i], need)]
            else:
                pieces, left = [], need
                while left:
                    size, start = self._sizes[-1]
                    pieces.append(self._take(size, start, min(size, left)))
                    left -= pieces[-1][1]
            return Allocation(key, nbytes, tuple(pieces))

    def commit(self, alloc: Allocation) -> None:
        """Publish a reserved chunk; if another write of the key won meanwhile, undo ours."""
        with self._lock:
            if alloc.key in self._where:
                for piece in alloc.pieces:
                    self._give(*piece)
            else:
                self._where[alloc.key] = alloc

    def abort(self, alloc: Allocation) -> None:
        with self._lock:
            for piece in alloc.pieces:
                self._give(*piece)

    def lookup(self, key: ChunkKey) -> Allocation | None:
        return self._where.get(key)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                alloc = self._where.pop(key, None)
                if alloc is not None:
                    for piece in alloc.pieces:
                        self._give(*piece)

    def detach(self, key: ChunkKey) -> Allocation | None:
        """Forget ``key`` but keep its extents taken: readers still hold them. The key may
        be stored anew (in other extents) meanwhile; ``abort`` gives these back later."""
        with self._lock:
            return self._where.pop(key, None)

    def keys(self) -> list[ChunkKey]:
        return list(self._where)

    def __len__(self) -> int:
        return len(self._where)

    # ---- the free list (called with the lock held) ----------------------------------

    def _take(self, size: int, start: int, need: int) -> tuple[int, int]:
        """Cut ``need`` bytes from the front of the free extent ``(size, start)``."""
        self._unlist(start, size)
        if size > need:
            self._list(start + need, size - need)
        self._free -= need
        return start, need

    def _give(self, start: int, size: int) -> None:
        """Return an extent to the free list, merged with free neighbours."""
        self._free += size
        end = start + size
        before = self._by_end.get(start)
        if before is not None:
            self._unlist(before, start - before)
            start = before
        after = self._by_start.get(end)
        if after is not None:
            self._unlist(end, after)
            end += after
        self._list(start, end - start)

    def _list(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        bisect.insort(self._sizes, (size, start))

    def _unlist(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        i = bisect.bisect_left(self._sizes, (size, start))
        del self._sizes[i]


class ExtentTierOps:
    """What the dram and hbm tiers do alike once their region exists: table operations."""

    name: str
    _table: ExtentTable

    def cost(self, nbytes: int) -> int:
        return self._table.cost(nbytes)

    @property
    def free_bytes(self) -> int:
        return self._table.free_bytes

    def slot_handle(self, key: ChunkKey) -> tuple[int, int] | None:
        """``(payload offset in the region, length)`` of a chunk stored in one piece.

        None for a chunk the tier does not hold, or holds split in pieces (readers
        then get its bytes by copy instead).
        """
        alloc = self._table.lookup(key)
        if alloc is None or not alloc.contiguous:
            return None
        return alloc.payload_offset, alloc.length

    def delete(self, keys: Sequence[ChunkKey]) -> None:
        self._table.remove(keys)

    def detach(self, key: ChunkKey) -> Allocation | None:
        """Delete ``key`` but keep its bytes where they are until ``release`` (a reader
        still copies them out); storing the key again meanwhile takes other room."""
        return self._table.detach(key)

    def release(self, held: Allocation) -> None:
        """Give back the room ``detach`` kept."""
        self._table.abort(held)

    def scan(self) -> Iterator[StoredChunk]:
        return iter(())

    def __len__(self) -> int:
        return len(self._table)
