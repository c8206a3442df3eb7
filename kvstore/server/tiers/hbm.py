"""GPU HBM tier: one CuPy device allocation shared by chunks of any size.

Offers ``HbmTier``: the ``Tier`` interface plus ``read_into(key, dest)`` and
``slot_handle(key)``. ``read`` copies device to host and returns ``bytearray``s.
Space is handed out by an ``ExtentTable`` (the same as the dram tier's), so
``cost(n)`` is the payload plus its key rounded up to 512 B. Bytes are copied
with no lock held. CuPy is imported lazily here and nowhere else, so hosts
without a GPU never need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

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


def _cupy() -> ModuleType:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device visible")
    except Exception as e:  # no CuPy, no driver, no device: one actionable message for all
        raise KVStoreError(f"the hbm tier needs CuPy and a CUDA device ({e})") from e
    return cupy


class HbmTier(ExtentTierOps):
    persistent = False

    def __init__(self, capacity_bytes: int, *, device: int = 0, name: str = "hbm") -> None:
        self.name = name
        self._table = ExtentTable(name, capacity_bytes)
        self.capacity_bytes = self._table.capacity_bytes
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
        """Copy a batch host to device, all or nothing; ``TierFullError`` if room runs out."""
        slab = self._live()
        latest = {check_key(r.key): as_u8(r.payload) for r in records}
        allocs: list[tuple[Allocation, np.ndarray]] = []
        try:
            for key, src in latest.items():
                alloc = self._table.reserve(key, src.nbytes)
                if alloc is not None:
                    allocs.append((alloc, src))
            with self._device:
                for alloc, src in allocs:
                    at = alloc.pieces[0][0]
                    slab[at : at + KEY_BYTES].set(np.frombuffer(alloc.key, dtype=np.uint8))
                    done = 0
                    for off, n in alloc.payload_spans():
                        slab[off : off + n].set(src[done : done + n])
                        done += n
                # The caller may reuse its buffers once write() returns.
                self._cp.cuda.get_current_stream().synchronize()
        except BaseException:
            for alloc, _ in allocs:
                self._table.abort(alloc)
            raise
        for alloc, _ in allocs:
            self._table.commit(alloc)

    def read(self, keys: Sequence[ChunkKey]) -> list[bytearray | None]:
        out: list[bytearray | None] = []
        for key in keys:
            alloc = self._table.lookup(key)
            if alloc is None:
                out.append(None)
                continue
            host = bytearray(alloc.length)
            self.read_into(key, host)
            out.append(host)
        return out

    def read_into(self, key: ChunkKey, dest: bytearray | memoryview | np.ndarray) -> int | None:
        """Copy one chunk device to host into ``dest``; its length, or None if absent."""
        slab = self._live()
        alloc = self._table.lookup(key)
        if alloc is None:
            return None
        out = as_u8(dest, "dest")
        if out.nbytes < alloc.length:
            raise InvalidArgument(
                f"{self.name}: dest holds {out.nbytes} B, chunk is {alloc.length} B"
            )
        with self._device:
            done = 0
            for off, n in alloc.payload_spans():
                slab[off : off + n].get(out=out[done : done + n])
                done += n
        return alloc.length

    def close(self) -> None:
        """Free the slab. Idempotent."""
        self._slab = None

    def _live(self):
        if self._slab is None:
            raise KVStoreError(f"{self.name} tier is closed")
        return self._slab
