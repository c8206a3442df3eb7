"""A put as the put process does it: check, copy into the store's room, persist, commit.

Offers ``StoreChannel`` (the put process's private line to its store: one authenticated
Unix-socket connection per thread, pickled tuples, see ``kvstore.server.put_process``)
and ``ForwardingStore``, which stands in for ``TieredStore`` behind the put process's
``KVStoreService``: its ``put(records, owner)`` keeps ``put``'s contract.

Per batch: every payload's checksum is checked here; the store is asked for room (in its
shared DRAM region, and in the last tier under write-through); the payloads are copied
into that room and written to LMDB here; then one small commit tells the store what is
where. The store never hashes, copies, compresses or writes these bytes itself, so its
lookups do not wait behind them. A batch the store gives no room to in full (a key it
holds in another namespace, a full or fragmented region, a key another put is writing)
goes to the store whole as an ordinary put, so parents and children are never split
between the two paths.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client

import numpy as np

from kvstore.core.lanes import spread
from kvstore.core.regions import map_region
from kvstore.core.types import (
    KEY_BYTES,
    ChunkRecord,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PutResult,
    TierFullError,
)
from kvstore.server.put_checks import validate_record

log = logging.getLogger("kvstore.put_process")
COPY_PIECE = 4 << 20  # numpy lets the GIL go for each piece's copy
_ERRORS = {
    "TierFullError": TierFullError,
    "InvalidArgument": InvalidArgument,
    "NotFound": NotFound,
}


class StoreChannel:
    """Calls to the store over the private channel; thread-safe (a connection per thread)."""

    def __init__(self, address: str, authkey: bytes, generation: int) -> None:
        self.address, self.authkey, self.generation = address, authkey, generation
        self._local = threading.local()

    def call(self, *message):
        try:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = Client(self.address, "AF_UNIX", authkey=self.authkey)
                conn.send(("hello", self.generation))
            conn.send(message)
            status, *answer = conn.recv()
        except (OSError, EOFError):
            # The store went away, or the line broke under a reservation that nobody
            # would ever commit or give back: this process goes, so that the store
            # reclaims all it held and starts a fresh one. Its clients see UNAVAILABLE
            # and put to the store itself.
            log.error("the channel to the store broke; the put process exits")
            os._exit(3)
        if status == "ok":
            return answer[0]
        kind, text = answer
        raise _ERRORS.get(kind, KVStoreError)(text)


class _Region:
    """The store's DRAM region, mapped shared and writable."""

    def __init__(self, name: str) -> None:
        try:
            self.map = map_region(name)
        except OSError as exc:
            raise KVStoreError(f"cannot map the store's region {name!r}: {exc}") from exc
        self.arr = np.frombuffer(self.map, dtype=np.uint8)

    def copy_in(self, offset: int, length: int, key: bytes, payload) -> bool:
        """Copy ``payload`` into the room at ``offset``; False (nothing written) when the
        room does not fit it or is not headed by ``key``."""
        src = np.frombuffer(payload, dtype=np.uint8)
        end = offset + length
        if offset < KEY_BYTES or end > self.arr.nbytes or src.nbytes != length:
            return False
        if self.arr[offset - KEY_BYTES : offset].tobytes() != key:
            return False
        for at in range(0, length, COPY_PIECE):
            np.copyto(
                self.arr[offset + at : min(end, offset + at + COPY_PIECE)],
                src[at : at + COPY_PIECE],
            )
        return True


class ForwardingStore:
    """``put`` for the put process's service; see the module docstring."""

    def __init__(
        self,
        channel: StoreChannel,
        nvme,
        max_chunk_bytes: int | None,
        refused: Callable[[str], None] = lambda code: None,
    ) -> None:
        self.channel = channel
        self._refused = refused  # told the code of each chunk refused here
        self.nvme = nvme  # an NvmeTier on the store's directory (lock_dir=False), or None
        self.max_chunk_bytes = max_chunk_bytes
        self._regions: dict[str, _Region] = {}
        self._regions_lock = threading.Lock()

    def put(self, records: Sequence[ChunkRecord], owner: bytes | None = None) -> PutResult:
        verdicts = spread(  # checksums without the GIL, on several cores for a large batch
            [functools.partial(validate_record, r, self.max_chunk_bytes) for r in records],
            [memoryview(r.payload).nbytes for r in records],
        )
        rejected: list[tuple[bytes, str]] = []
        refused: set[bytes] = set()
        good: list[ChunkRecord] = []
        for rec, err in zip(records, verdicts, strict=True):
            if err is None and rec.parent is not None and rec.parent in refused:
                err = ("parent_rejected", "parent was rejected")
            if err is None:
                good.append(rec)
            else:
                rejected.append((rec.key, err[1]))
                refused.add(rec.key)
                self._refused(err[0])
        if not good:
            return PutResult(0, 0, rejected)
        result = self._put_checked(good, owner)
        return PutResult(result.stored, result.duplicates, rejected + list(result.rejected))

    def _put_checked(self, records: list[ChunkRecord], owner: bytes | None) -> PutResult:
        chunks = [(r.key, r.parent, r.ns, memoryview(r.payload).nbytes) for r in records]
        ticket, refs, stored, persist, chain_ns = self.channel.call("reserve", chunks, owner)
        if any(ref is None and not held for ref, held in zip(refs, stored)):
            if ticket is not None:
                self.channel.call("abort", ticket, [])
            return self._put_plainly(records, owner)
        if ticket is None:  # the store holds every one of them already
            return PutResult(0, len(records), [])
        roomed = [(rec, ref) for rec, ref in zip(records, refs) if ref is not None]
        written: list[bytes] = []
        try:
            for rec, (region, offset, length) in roomed:
                if not self._region(region).copy_in(offset, length, rec.key, rec.payload):
                    raise KVStoreError(f"room for chunk {rec.key.hex()} does not match it")
            if persist and self.nvme is not None:
                # under the namespace the store files each chunk in: its chain's
                written = self._persist(
                    [dataclasses.replace(rec, ns=chain_ns[rec.key]) for rec, _ in roomed]
                )
        except BaseException:
            self.channel.call("abort", ticket, [rec.key for rec, _ in roomed])
            raise
        stored_n, dups, rejected = self.channel.call("commit", ticket, owner, written)
        return PutResult(stored_n, dups + sum(stored), rejected)

    def _persist(self, records: list[ChunkRecord]) -> list[bytes]:
        """Write the chunks to LMDB; none written (the store then writes them itself, or
        says why it could not) when this fails, a full disk say."""
        try:
            self.nvme.write(records)
        except KVStoreError:
            return []
        return [r.key for r in records]

    def _put_plainly(self, records: list[ChunkRecord], owner: bytes | None) -> PutResult:
        plain = [(r.key, r.parent, r.ns, bytes(memoryview(r.payload))) for r in records]
        stored, dups, rejected = self.channel.call("put", plain, owner)
        return PutResult(stored, dups, rejected)

    def _region(self, name: str) -> _Region:
        with self._regions_lock:
            region = self._regions.get(name)
            if region is None:
                region = self._regions[name] = _Region(name)
            return region
