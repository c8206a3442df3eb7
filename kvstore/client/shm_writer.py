"""Same-host puts, client side: ask the store for room in its shared memory, copy each
payload straight into it, commit. Offers ``put_same_host(client, records)``.

One copy, from the caller's buffer into the store's region, instead of encoding,
sending, receiving and copying every byte. Chunks the store gives no room to (its
shared memory is full or fragmented, or shared memory is not offered) go over the
ordinary Put; chunks it already holds are not sent at all. Never writes outside the
room the store gave, and never writes a room whose key does not match the chunk.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvstore.core.lanes import spread
from kvstore.core.types import KEY_BYTES, ChunkRecord, PutResult
from kvstore.rpc.pb import pb

SHM_DIR = "/dev/shm"
PIECE = 4 << 20  # a large chunk's copy is split so that it too can use several cores


class _Region:
    """The store's region, mapped shared and writable (same host, same user)."""

    def __init__(self, name: str) -> None:
        if "/" in name or not name.startswith("kvstore-"):
            raise OSError(f"not a kvstore region: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.arr = np.frombuffer(self.map, dtype=np.uint8)

    def write_all(self, rooms: Sequence[tuple[pb.ShmHandle, bytes, object]]) -> list[bool]:
        """Copy each ``(handle, key, payload)`` into its room; False for a room that does
        not fit the payload or holds another key (nothing is written there). The copies
        go in pieces of at most ``PIECE`` bytes, spread over the host's cores."""
        ok: list[bool] = []
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        for handle, key, payload in rooms:
            src = np.frombuffer(payload, dtype=np.uint8)  # any C-contiguous buffer
            start, end = handle.offset, handle.offset + handle.length
            fits = start >= KEY_BYTES and end <= self.arr.nbytes and src.nbytes == handle.length
            ok.append(fits and self.arr[start - KEY_BYTES : start].tobytes() == key)
            if ok[-1]:
                dest = self.arr[start:end]
                pieces += [
                    (dest[i : i + PIECE], src[i : i + PIECE]) for i in range(0, src.nbytes, PIECE)
                ]
        spread(
            [functools.partial(np.copyto, d, s) for d, s in pieces], [s.nbytes for _, s in pieces]
        )
        return ok

    def close(self) -> None:
        self.arr = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.map.close()


def _region(client, name: str) -> _Region:
    """The client's mapping of the store's region, kept across puts: mapping it afresh
    page-faulted every page a put wrote (64 MiB puts ran at 0.11x memcpy). A new name
    means the store restarted: the old mapping is closed."""
    cached = getattr(client, "_shm_put_region", None)
    if cached is not None and cached[0] == name:
        return cached[1]
    close_region(client)
    region = _Region(name)
    client._shm_put_region = (name, region)
    return region


def close_region(client) -> None:
    cached = getattr(client, "_shm_put_region", None)
    client._shm_put_region = None
    if cached is not None:
        cached[1].close()


def put_same_host(client, records: Sequence[ChunkRecord], timeout_s: float | None) -> PutResult:
    req = pb.ReserveShmRequest(
        chunks=[
            pb.ShmPutChunk(
                key=r.key,
                parent=r.parent or b"",
                namespace=r.ns or b"",
                length=memoryview(r.payload).nbytes,
            )
            for r in records
        ]
    )
    grant = client._call("ReserveShm", client._reserve_shm, req, timeout_s=timeout_s)
    dups = sum(1 for s in grant.stored if s)
    by_wire = [r for r, h, s in zip(records, grant.handles, grant.stored) if not h.region and not s]
    written: list[ChunkRecord] = []
    if grant.ticket:
        try:
            region = _region(client, next(h.region for h in grant.handles if h.region))
            roomed = [(r, h) for r, h in zip(records, grant.handles) if h.region]
            done = region.write_all([(h, r.key, r.payload) for r, h in roomed])
            for (rec, _), ok in zip(roomed, done, strict=True):
                (written if ok else by_wire).append(rec)
        except OSError:
            by_wire += [r for r, h in zip(records, grant.handles) if h.region and r not in written]
            written = []
            close_region(client)
        commit = pb.CommitShmRequest(ticket=grant.ticket)
        resp = client._call("CommitShm", client._commit_shm, commit, timeout_s=timeout_s)
        stored, dups = resp.stored, dups + resp.duplicates
        rejected = [(r.key, r.reason) for r in resp.rejected]
    else:
        stored, rejected = 0, []
    if by_wire:
        rest = client.put(by_wire, timeout_s)
        stored, dups, rejected = (
            stored + rest.stored,
            dups + rest.duplicates,
            rejected + rest.rejected,
        )
    return PutResult(stored, dups, rejected)
