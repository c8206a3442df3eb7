"""Same-host puts, client side: ask the store for room in its shared memory, copy each
payload straight into it, commit. Offers ``put_same_host(client, records)`` and ``Fill``.

One copy, from the caller's buffer into the store's region, instead of encoding,
sending, receiving and copying every byte; none for a ``Fill``, whose payload is written
straight into its room by its own ``write`` (an encoder, say). Chunks the store gives no
room to (its shared memory is full or fragmented, or shared memory is not offered) go
over the ordinary Put; chunks it already holds are not sent at all (nor written, for a
``Fill``). Never writes outside the room the store gave, and never writes a room whose
key does not match the chunk.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvstore.core import bulk_copy
from kvstore.core.lanes import spread
from kvstore.core.regions import map_region
from kvstore.core.types import KEY_BYTES, ChunkRecord, KVStoreError, PutResult
from kvstore.rpc.pb import pb

log = logging.getLogger(__name__)
PIECE = 4 << 20  # a large chunk's copy is split so that it too can use several cores
TRUSTED_FRACTION = 0.5  # of the reservation's ttl, counted from before it was asked for


@dataclass(frozen=True, slots=True)
class Fill:
    """A chunk whose payload is written where it is to be kept: ``write(out)`` fills
    ``out``, a writable buffer of exactly ``length`` bytes, with the whole payload (header
    and checksum included). Put with ``KVStoreClient.put`` (or the asyncio client's) like a
    ``ChunkRecord``; one whose ``write`` raises is refused, not raised."""

    key: bytes
    parent: bytes | None
    ns: bytes | None
    length: int
    write: Callable[[memoryview], object]

    def record(self) -> ChunkRecord:
        """The chunk with its payload in a buffer of its own (for a chunk given no room)."""
        out = memoryview(np.empty(self.length, dtype=np.uint8))
        self.write(out)
        return ChunkRecord(self.key, self.parent, self.ns, out)


def payload_bytes(r: ChunkRecord | Fill) -> int:
    """The size of a record's payload, written or to be written."""
    return r.length if isinstance(r, Fill) else memoryview(r.payload).nbytes


class _Region:
    """The store's region, mapped shared and writable (same host, same user)."""

    def __init__(self, name: str) -> None:
        self.map = map_region(name)
        self.arr = np.frombuffer(self.map, dtype=np.uint8)

    def write_all(
        self, rooms: Sequence[tuple[pb.ShmHandle, ChunkRecord | Fill]], until: float
    ) -> list[bool]:
        """Write each ``(handle, record)``'s payload into its room; False for a room that
        does not fit the payload or holds another key (nothing is written there), whose
        write was not finished before ``until`` (``time.monotonic``: after that the room
        may be another chunk's, so no write is started), or whose ``Fill`` failed. A
        ``Fill`` writes its own room, one after the other; the copies go in pieces of at
        most ``PIECE`` bytes, spread over the host's cores, streamed where the batch is
        large (``bulk_copy``)."""
        ok: list[bool] = []
        pieces: list[tuple[int, np.ndarray, np.ndarray]] = []
        fills: list[tuple[int, Fill, np.ndarray]] = []
        for handle, rec in rooms:
            start, end = handle.offset, handle.offset + handle.length
            inside = start >= KEY_BYTES and end <= self.arr.nbytes
            fits = inside and payload_bytes(rec) == handle.length
            ok.append(fits and self.arr[start - KEY_BYTES : start].tobytes() == rec.key)
            if not ok[-1]:
                continue
            dest = self.arr[start:end]
            if isinstance(rec, Fill):
                fills.append((len(ok) - 1, rec, dest))
                continue
            src = np.frombuffer(rec.payload, dtype=np.uint8)  # any C-contiguous buffer
            pieces += [
                (len(ok) - 1, dest[i : i + PIECE], src[i : i + PIECE])
                for i in range(0, src.nbytes, PIECE)
            ]
        for room, fill, dest in fills:
            ok[room] = _fill_before(fill, dest, until)
        copy = bulk_copy.copier(sum(s.nbytes for _, _, s in pieces))
        done = spread(
            [functools.partial(_copy_before, copy, d, s, until) for _, d, s in pieces],
            [s.nbytes for _, _, s in pieces],
        )
        for (room, _, _), copied in zip(pieces, done, strict=True):
            ok[room] = ok[room] and copied
        return ok

    def close(self) -> None:
        self.arr = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.map.close()


def _fill_before(fill: Fill, dest: np.ndarray, until: float) -> bool:
    """Whether ``fill`` was started in time and wrote its payload into ``dest``; one that
    raised did not (its room is refused at the commit, and the chunk goes to the wire,
    where a second failure refuses it and its chain's later chunks: ``for_wire``)."""
    if time.monotonic() >= until:
        return False
    try:
        fill.write(memoryview(dest))
    except Exception:
        log.debug("filling the room of chunk %s failed", fill.key.hex(), exc_info=True)
        return False
    return True  # started in time, as a copy: the commit checks what is in the room


def _copy_before(copy: bulk_copy.Copy, dest: np.ndarray, src: np.ndarray, until: float) -> bool:
    if time.monotonic() >= until:
        return False
    copy(dest, src)
    return True


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


def put_same_host(
    client, records: Sequence[ChunkRecord | Fill], timeout_s: float | None
) -> PutResult:
    """Put ``records`` (parents first) through the store's shared memory where it gives
    room, then send every chunk the commit did not store over ``Put``, in order.

    What goes over ``Put``: chunks given no room, rooms that could not be written (the
    region would not map, a room holds another key, or the reservation's time ran out:
    ``ShmReservation.ttl_s``), and chunks the commit refused
    (among them the children of a refused or unwritten chunk). ``Put``'s answer is the
    one reported for them, so a chunk is never counted twice, and it comes after the
    commit, so every chunk's parent is stored before it.
    """
    req = pb.ReserveShmRequest(
        chunks=[
            pb.ShmPutChunk(
                key=r.key,
                parent=r.parent or b"",
                namespace=r.ns or b"",
                length=payload_bytes(r),
            )
            for r in records
        ]
    )
    sent = time.monotonic()
    try:
        grant = client._call("ReserveShm", client._reserve_shm, req, timeout_s=timeout_s)
    except KVStoreError as exc:
        if getattr(exc, "code", None) != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return client.put(records, timeout_s)  # it offers no shared memory (server.shm: false)
    # the room is this writer's for grant.ttl_s from some time after ``sent``; a copy is
    # only started in the first half of that (a store too old to say: a short guess)
    until = sent + (grant.ttl_s or 1.0) * TRUSTED_FRACTION
    held = {r.key for r, s in zip(records, grant.stored, strict=True) if s}
    stored, dups = 0, len(held)
    committed: set[bytes] = set()
    if grant.ticket:
        roomed = [(r, h) for r, h in zip(records, grant.handles, strict=True) if h.region]
        try:
            region = _region(client, roomed[0][1].region)
            done = region.write_all([(h, r) for r, h in roomed], until)
        except OSError:
            done = [False] * len(roomed)
            close_region(client)
        # Committed even when nothing was written: the store refuses unwritten room
        # (it spoils each room's header when it hands it out) and takes it back now.
        commit = pb.CommitShmRequest(ticket=grant.ticket)
        try:
            resp = client._call("CommitShm", client._commit_shm, commit, timeout_s=timeout_s)
        except KVStoreError as exc:
            if getattr(exc, "code", None) != grpc.StatusCode.NOT_FOUND:
                raise
            resp = None  # the reservation lapsed first: nothing of it was stored
        if resp is not None:
            refused = {r.key for r in resp.rejected}
            committed = {r.key for (r, _), ok in zip(roomed, done) if ok and r.key not in refused}
            stored, dups = resp.stored, dups + resp.duplicates
    by_wire = [r for r in records if r.key not in held and r.key not in committed]
    if not by_wire:
        return PutResult(stored, dups, [])
    rest = client.put(by_wire, timeout_s)  # a Fill is written into a buffer of its own there
    return PutResult(stored + rest.stored, dups + rest.duplicates, rest.rejected)


def for_wire(
    records: Sequence[ChunkRecord | Fill],
) -> tuple[list[ChunkRecord], list[tuple[bytes, str]]]:
    """``records`` with every ``Fill``'s payload written into a buffer of its own, and the
    chunks refused here: a ``Fill`` whose ``write`` raised, and the chunks after it in its
    chain (a chunk is never sent without its parent). The others are not held up."""
    out: list[ChunkRecord] = []
    refused: dict[bytes, str] = {}
    for r in records:
        if r.parent is not None and r.parent in refused:
            refused[r.key] = "parent was rejected"
            continue
        if isinstance(r, Fill):
            try:
                r = r.record()
            except Exception as exc:  # the caller's encoder: its chunk alone is refused
                refused[r.key] = f"its payload could not be written: {exc!r}"
                continue
        out.append(r)
    return out, list(refused.items())
