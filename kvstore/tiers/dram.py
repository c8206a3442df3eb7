"""Host DRAM tier: one shared-memory region (``/dev/shm``) cut into fixed-size slots.

Offers ``DramTier`` (the ``Tier`` interface plus ``read_into``, ``slot_handle``,
``region_name``, ``slot_bytes``) and ``attach_region(name)`` for a same-host client
that maps the region to read slots zero-copy.

A chunk occupies a whole slot, so ``cost(n)`` is ``slot_bytes``. ``read`` returns
read-only views into the region: a view stays valid until its key is deleted or
overwritten, so a caller that keeps the bytes longer copies them out (``read_into``
copies straight into the caller's buffer). Writes and deletes are serialized; reads
take no lock, so the caller keeps a key from being deleted while it reads it (the
index's leases do). Pinning the region with
``cudaHostRegister`` belongs to the CUDA side, so this module stays free of torch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

from kvstore.tiers.buffers import as_u8
from kvstore.tiers.slots import SlotTable, SlotTierOps
from kvstore.types import ChunkKey, ChunkRecord, InvalidArgument, KVStoreError

SHM_DIR = "/dev/shm"


def attach_region(name: str) -> mmap.mmap:
    """Map an existing region read-only by its ``region_name`` (same host, any process).

    Plain ``mmap`` of ``/dev/shm/<name>`` rather than ``SharedMemory(create=False)``:
    on Python < 3.13 the latter registers the region with the attaching process's
    resource tracker, which unlinks it when that process exits.
    """
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


class DramTier(SlotTierOps):
    persistent = False

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        region_name: str | None = None,
        name: str = "dram",
    ) -> None:
        if slot_bytes <= 0:
            raise InvalidArgument(f"dram slot_bytes must be positive, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        self.name = name
        self.slot_bytes = slot_bytes
        self.capacity_bytes = num_slots * slot_bytes
        self._table = SlotTable(name, num_slots, slot_bytes)
        self._mutate = threading.Lock()  # writes and deletes; reads take no lock
        _check_shm_room(self.capacity_bytes)
        region_name = region_name or f"kvstore-{secrets.token_hex(6)}"
        try:
            self._shm = shared_memory.SharedMemory(
                name=region_name, create=True, size=self.capacity_bytes
            )
        except FileExistsError as e:
            raise KVStoreError(
                f"shared-memory region {region_name!r} already exists: another store runs, "
                f"or one crashed and left it; remove {SHM_DIR}/{region_name} if it is stale"
            ) from e
        self.region_name = self._shm.name
        self._arr: np.ndarray | None = np.frombuffer(self._shm.buf, dtype=np.uint8)
        # Touch every page now so the first writes run at copy speed, not fault speed.
        self._arr.fill(0)

    def write(self, records: Sequence[ChunkRecord]) -> None:
        """Store a batch, all or nothing: ``TierFullError`` if the free slots do not suffice."""
        arr = self._region()
        latest = self._table.payloads_by_key(records)
        keys = list(latest)
        with self._mutate:
            slots = self._table.reserve(keys)
            try:
                for slot, src in zip(slots, latest.values(), strict=True):
                    off = slot * self.slot_bytes
                    np.copyto(arr[off : off + src.nbytes], src)
            except BaseException:
                self._table.abort(keys, slots)
                raise
            self._table.commit(keys, slots, [src.nbytes for src in latest.values()])

    def read(self, keys: Sequence[ChunkKey]) -> list[memoryview | None]:
        """Zero-copy, read-only views; each valid until its key is deleted or overwritten."""
        buf = self._region().data
        out: list[memoryview | None] = []
        for key in keys:
            where = self.slot_handle(key)
            out.append(None if where is None else buf[where[0] : where[0] + where[1]].toreadonly())
        return out

    def read_into(self, key: ChunkKey, dest: bytearray | memoryview | np.ndarray) -> int | None:
        """Copy one chunk into the writable buffer ``dest``; its length, or None if absent."""
        arr = self._region()
        where = self.slot_handle(key)
        if where is None:
            return None
        off, length = where
        out = as_u8(dest, "dest")
        if out.nbytes < length:
            raise InvalidArgument(f"{self.name}: dest holds {out.nbytes} B, chunk is {length} B")
        np.copyto(out[:length], arr[off : off + length])
        return length

    def close(self) -> None:
        """Unmap and unlink the region. Idempotent."""
        if self._arr is None:
            return
        self._arr = None
        # BufferError: views from read() are still alive; the mapping goes with the last one.
        with contextlib.suppress(BufferError):
            self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()

    def _region(self) -> np.ndarray:
        if self._arr is None:
            raise KVStoreError(f"{self.name} tier is closed")
        return self._arr


def _check_shm_room(nbytes: int) -> None:
    # Touching pages past the tmpfs limit kills the process with SIGBUS; fail clearly instead.
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise InvalidArgument(
            f"dram tier needs {nbytes} B of shared memory but {SHM_DIR} has {free} B free; "
            "lower dram capacity or enlarge /dev/shm (docker: --shm-size)"
        )
