"""GPU HBM tier: one CuPy device allocation cut into fixed-size slots.

Offers ``HbmTier``: the ``Tier`` interface plus ``read_into(key, dest)``,
``device_ptr(key)`` and ``slot_handle(key)``. ``read`` copies device to host and
returns ``bytearray``s. A chunk occupies a whole slot, so ``cost(n)`` is
``slot_bytes``. CuPy is imported lazily here and nowhere else, so hosts without a
GPU never need it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from kvstore.tiers.buffers import as_u8
from kvstore.tiers.slots import SlotTable, SlotTierOps
from kvstore.types import ChunkKey, ChunkRecord, InvalidArgument, KVStoreError


def _cupy() -> ModuleType:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device visible")
    except Exception as e:  # no CuPy, no driver, no device: one actionable message for all
        raise KVStoreError(f"the hbm tier needs CuPy and a CUDA device ({e})") from e
    return cupy


class HbmTier(SlotTierOps):
    persistent = False

    def __init__(
        self, capacity_bytes: int, slot_bytes: int, *, device: int = 0, name: str = "hbm"
    ) -> None:
        if slot_bytes <= 0:
            raise InvalidArgument(f"hbm slot_bytes must be positive, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        self.name = name
        self.slot_bytes = slot_bytes
        self.capacity_bytes = num_slots * slot_bytes
        self._table = SlotTable(name, num_slots, slot_bytes)
        self._mutate = threading.Lock()  # writes and deletes; reads take no lock
        self._cp = _cupy()
        self._device = self._cp.cuda.Device(device)
        with self._device:
            # A plain cudaMalloc, not the memory pool: the slab lives as long as the tier, its
            # base pointer is what CUDA IPC will export, and close() must really free it.
            mem = self._cp.cuda.Memory(self.capacity_bytes)
            self._slab = self._cp.ndarray(
                (self.capacity_bytes,),
                dtype=self._cp.uint8,
                memptr=self._cp.cuda.MemoryPointer(mem, 0),
            )

    def write(self, records: Sequence[ChunkRecord]) -> None:
        """Copy a batch host to device, all or nothing; ``TierFullError`` if slots run out."""
        slab = self._live()
        latest = self._table.payloads_by_key(records)
        keys = list(latest)
        with self._mutate:
            slots = self._table.reserve(keys)
            try:
                with self._device:
                    for slot, src in zip(slots, latest.values(), strict=True):
                        off = slot * self.slot_bytes
                        slab[off : off + src.nbytes].set(src)
                    # The caller may reuse its buffers once write() returns.
                    self._cp.cuda.get_current_stream().synchronize()
            except BaseException:
                self._table.abort(keys, slots)
                raise
            self._table.commit(keys, slots, [src.nbytes for src in latest.values()])

    def read(self, keys: Sequence[ChunkKey]) -> list[bytearray | None]:
        out: list[bytearray | None] = []
        for key in keys:
            where = self._table.lookup(key)
            if where is None:
                out.append(None)
                continue
            host = bytearray(where[1])
            self.read_into(key, host)
            out.append(host)
        return out

    def read_into(self, key: ChunkKey, dest: bytearray | memoryview | np.ndarray) -> int | None:
        """Copy one chunk device to host into ``dest``; its length, or None if absent."""
        slab = self._live()
        where = self.slot_handle(key)
        if where is None:
            return None
        off, length = where
        out = as_u8(dest, "dest")
        if out.nbytes < length:
            raise InvalidArgument(f"{self.name}: dest holds {out.nbytes} B, chunk is {length} B")
        with self._device:
            slab[off : off + length].get(out=out[:length])
        return length

    def device_ptr(self, key: ChunkKey) -> int | None:
        """The device address of a stored chunk, valid until it is deleted or overwritten."""
        where = self.slot_handle(key)
        if where is None:
            return None
        return self._live().data.ptr + where[0]

    def close(self) -> None:
        """Free the slab. Idempotent."""
        self._slab = None

    def _live(self):
        if self._slab is None:
            raise KVStoreError(f"{self.name} tier is closed")
        return self._slab
