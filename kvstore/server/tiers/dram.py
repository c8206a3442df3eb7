"""Host DRAM tier: one shared-memory region (``/dev/shm``) shared by chunks of any size.

Offers ``DramTier`` (the ``Tier`` interface plus ``read_into``, ``slot_handle``,
``region_name``, and ``stage``/``staged_view``/``unstage`` for same-host writers).
Space is handed out by an ``ExtentTable``: each chunk takes its
16-byte key and its payload, rounded up to 512 B, so ``cost(n)`` is that, and
one region serves every chunk size and namespace at once.

``read`` returns read-only views into the region for chunks stored in one piece
(a copy for a chunk split over several): a view stays valid until its key is
deleted, so a caller that keeps the bytes longer copies them out (``read_into``
copies straight into the caller's buffer). Bytes are copied with no lock held;
the caller keeps a key from being deleted while it reads it (the index's leases
do). Same-host readers find the key in the 16 bytes before each payload and
check it. A put's payload is copied in with streaming stores (``bulk_copy``): nobody
reads it again soon, so it need not pass through the cache. Pinning the region with
``cudaHostRegister`` belongs to the CUDA side, so this module stays free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.core import bulk_copy
from kvstore.core.payload import HEADER_BYTES
from kvstore.core.types import (
    KEY_BYTES,
    ChunkKey,
    ChunkRecord,
    InvalidArgument,
    KVStoreError,
    check_key,
)
from kvstore.server.tiers.buffers import as_u8
from kvstore.server.tiers.extents import Allocation, ExtentTable, ExtentTierOps
from kvstore.server.tiers.pacing import PIECE, step_aside
from kvstore.server.tiers.shm_region import ShmRegion, reclaim_stale

_NO_HEADER = bytes(HEADER_BYTES)
COPY_PIECE = 4 * PIECE  # a put's copy into the region, 1 MiB at a time (~0.2 ms each)


class DramTier(ExtentTierOps):
    persistent = False

    def __init__(
        self, capacity_bytes: int, *, region_name: str | None = None, name: str = "dram"
    ) -> None:
        self.name = name
        self._table = ExtentTable(name, capacity_bytes)
        self.capacity_bytes = self._table.capacity_bytes
        reclaim_stale()
        self._region = ShmRegion(self.capacity_bytes, region_name)
        self.region_name = self._region.name
        self._staged: dict[ChunkKey, Allocation] = {}  # room given to same-host writers
        self._arr: np.ndarray | None = np.frombuffer(self._region.mmap, dtype=np.uint8)
        # Touch every page now so the first writes run at copy speed, not fault speed.
        self._arr.fill(0)
        self._base = self._arr.ctypes.data  # where the region starts in this process
        # a put's copy into the region: built now (once per host, ~0.5 s), not in a put
        self._put_copy = bulk_copy.uncached_copier()

    def stage(self, key: ChunkKey, nbytes: int) -> tuple[int, int] | None:
        """Room for a same-host writer to fill: ``(payload offset, length)`` in the region,
        with the key already written before it; None when no single extent holds it.

        The room is nobody's chunk until ``write`` is given a record with that key whose
        payload is exactly that room (then it is published without a copy), and is
        given back by ``unstage``. ``TierFullError`` when the free bytes do not suffice.
        """
        arr = self._live()
        if check_key(key) in self._staged:
            return None  # another writer's room for it: one room per key (see unstage)
        alloc = self._table.reserve(key, nbytes)
        if alloc is None or not alloc.contiguous:
            if alloc is not None:
                self._table.abort(alloc)
            return None
        at = alloc.pieces[0][0]
        mem = arr.data  # memoryview writes: a numpy slice assignment costs ten times more
        mem[at : at + KEY_BYTES] = alloc.key
        # The room still holds whatever chunk lived there last, checksum and all: spoil
        # its header, so that room committed without being written can never pass for
        # a chunk (the old bytes published under the new key).
        head = alloc.payload_offset
        n = min(HEADER_BYTES, alloc.length)
        mem[head : head + n] = _NO_HEADER[:n]
        self._staged[key] = alloc
        return alloc.payload_offset, alloc.length

    def staged_view(self, key: ChunkKey) -> memoryview | None:
        """The room ``stage`` gave for ``key``, as the writer filled it."""
        alloc = self._staged.get(key)
        if alloc is None:
            return None
        off = alloc.payload_offset
        return self._live().data[off : off + alloc.length]

    def unstage(self, keys: Sequence[ChunkKey]) -> None:
        """Give back staged room that was not published."""
        for key in keys:
            alloc = self._staged.pop(key, None)
            if alloc is not None:
                self._table.abort(alloc)

    def write(self, records: Sequence[ChunkRecord]) -> None:
        """Store a batch, all or nothing: ``TierFullError`` if the free bytes do not suffice.

        A key stored already keeps its bytes (the key names the content). A record
        whose payload is the room ``stage`` gave its key is published in place.
        """
        arr = self._live()
        latest = {check_key(r.key): as_u8(r.payload) for r in records}
        allocs: list[tuple[Allocation, np.ndarray]] = []
        in_place = [k for k, src in latest.items() if self._is_staged_room(k, src)]
        for key in in_place:
            self._table.commit(self._staged.pop(key))
            del latest[key]
        try:
            for key, src in latest.items():
                alloc = self._table.reserve(key, src.nbytes)
                if alloc is not None:
                    allocs.append((alloc, src))
            for alloc, src in allocs:
                self._copy_in(arr, alloc, src)
        except BaseException:
            for alloc, _ in allocs:
                self._table.abort(alloc)
            raise
        for alloc, _ in allocs:
            self._table.commit(alloc)

    def _copy_in(self, arr: np.ndarray, alloc: Allocation, src: np.ndarray) -> None:
        key_at = alloc.pieces[0][0]
        arr[key_at : key_at + KEY_BYTES] = np.frombuffer(alloc.key, dtype=np.uint8)
        copy = self._put_copy
        done = 0
        for off, n in alloc.payload_spans():
            for at in range(0, n, COPY_PIECE):  # in pieces: see pacing
                m = min(COPY_PIECE, n - at)
                copy(arr[off + at : off + at + m], src[done + at : done + at + m])
                step_aside()
            done += n

    def _is_staged_room(self, key: ChunkKey, src: np.ndarray) -> bool:
        alloc = self._staged.get(key)
        return (
            alloc is not None
            and src.nbytes == alloc.length
            and src.ctypes.data == self._base + alloc.payload_offset
        )

    def read(self, keys: Sequence[ChunkKey]) -> list[memoryview | bytearray | None]:
        """Zero-copy, read-only views (copies for split chunks); valid until deleted."""
        arr = self._live()
        out: list[memoryview | bytearray | None] = []
        for key in keys:
            alloc = self._table.lookup(key)
            if alloc is None:
                out.append(None)
            elif alloc.contiguous:
                off = alloc.payload_offset
                out.append(arr.data[off : off + alloc.length].toreadonly())
            else:
                buf = bytearray(alloc.length)
                self._copy_out(arr, alloc, np.frombuffer(buf, dtype=np.uint8))
                out.append(buf)
        return out

    def read_into(self, key: ChunkKey, dest: bytearray | memoryview | np.ndarray) -> int | None:
        """Copy one chunk into the writable buffer ``dest``; its length, or None if absent."""
        arr = self._live()
        alloc = self._table.lookup(key)
        if alloc is None:
            return None
        out = as_u8(dest, "dest")
        if out.nbytes < alloc.length:
            raise InvalidArgument(
                f"{self.name}: dest holds {out.nbytes} B, chunk is {alloc.length} B"
            )
        self._copy_out(arr, alloc, out)
        return alloc.length

    @staticmethod
    def _copy_out(arr: np.ndarray, alloc: Allocation, out: np.ndarray) -> None:
        done = 0
        for off, n in alloc.payload_spans():
            np.copyto(out[done : done + n], arr[off : off + n])
            done += n

    def close(self) -> None:
        """Unmap and unlink the region. Idempotent."""
        if self._arr is None:
            return
        self._arr = None
        self._region.close()

    def _live(self) -> np.ndarray:
        if self._arr is None:
            raise KVStoreError(f"{self.name} tier is closed")
        return self._arr
