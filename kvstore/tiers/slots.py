"""Bookkeeping for a memory region cut into equal slots (shared by the dram and hbm tiers).

No I/O: it only decides which slot holds which key. Offers ``SlotTable`` with
``payloads_by_key(records)`` (a batch checked against the slot size),
``reserve(keys)`` (all or nothing, ``TierFullError``), ``commit(keys, slots, lengths)``
(publish a reserved batch), ``abort(keys, slots)``, ``lookup(key)``, ``remove(keys)``,
``free_slots`` and ``used_slots``; and ``SlotTierOps``, the table-only methods both
slot tiers share. A write reserves, copies its bytes, then commits,
so a lock-free ``lookup`` never finds a new key whose bytes are half written. A key
already stored keeps its slot and is overwritten in place: a chunk costs one slot,
as the index counts it, even while it is being rewritten.

Not locked: the owning tier serializes reserve..commit and remove, so a slot being
rewritten in place cannot be freed and handed to another key mid-copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.tiers.base import StoredChunk
from kvstore.tiers.buffers import as_u8
from kvstore.types import ChunkKey, ChunkRecord, InvalidArgument, TierFullError, check_key


class SlotTable:
    def __init__(self, tier: str, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 1:
            raise InvalidArgument(f"{tier}: capacity must hold at least one slot of {slot_bytes} B")
        self.tier = tier
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free: deque[int] = deque(range(num_slots))
        self._where: dict[ChunkKey, tuple[int, int]] = {}

    def payloads_by_key(self, records: Sequence[ChunkRecord]) -> dict[ChunkKey, np.ndarray]:
        """A batch's payloads as byte views, the last one per key, each checked to fit a slot."""
        latest = {check_key(r.key): as_u8(r.payload) for r in records}
        for key, src in latest.items():
            if src.nbytes > self.slot_bytes:
                raise InvalidArgument(
                    f"{self.tier}: payload of {src.nbytes} B for key {key.hex()} exceeds "
                    f"slot_bytes={self.slot_bytes}; raise slot_bytes or use smaller chunks"
                )
        return latest

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def reserve(self, keys: Sequence[ChunkKey]) -> list[int]:
        """A slot for each (distinct) key: its own if stored, else a free one; all or none."""
        new = sum(1 for k in keys if k not in self._where)
        if new > len(self._free):
            raise TierFullError(
                f"{self.tier} tier full: batch needs {new} new slots of {self.slot_bytes} B, "
                f"{len(self._free)} of {self.num_slots} free"
            )
        return [self._where[k][0] if k in self._where else self._free.popleft() for k in keys]

    def abort(self, keys: Sequence[ChunkKey], slots: Sequence[int]) -> None:
        """Give back the slots ``reserve`` took from the free list."""
        for key, slot in zip(keys, slots, strict=True):
            if key not in self._where:
                self._free.append(slot)

    def commit(
        self, keys: Sequence[ChunkKey], slots: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Publish reserved slots."""
        for key, slot, length in zip(keys, slots, lengths, strict=True):
            self._where[key] = (slot, length)

    def lookup(self, key: ChunkKey) -> tuple[int, int] | None:
        """``(slot, length)`` of a stored key, else None."""
        return self._where.get(key)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            old = self._where.pop(key, None)
            if old is not None:
                self._free.append(old[0])

    def __len__(self) -> int:
        return len(self._where)


class SlotTierOps:
    """What the dram and hbm tiers do alike once their region exists: table operations."""

    name: str
    slot_bytes: int
    _table: SlotTable
    _mutate: threading.Lock

    def cost(self, nbytes: int) -> int:
        return self.slot_bytes

    @property
    def free_slots(self) -> int:
        return self._table.free_slots

    def slot_handle(self, key: ChunkKey) -> tuple[int, int] | None:
        """``(byte offset in the region, length)`` of a stored chunk, else None."""
        where = self._table.lookup(key)
        if where is None:
            return None
        return where[0] * self.slot_bytes, where[1]

    def delete(self, keys: Sequence[ChunkKey]) -> None:
        with self._mutate:
            self._table.remove(keys)

    def scan(self) -> Iterator[StoredChunk]:
        return iter(())

    def __len__(self) -> int:
        return len(self._table)
