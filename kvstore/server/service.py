"""The gRPC servicer: translates protobuf to store calls and store errors to status codes.

Offers ``KVStoreService``, the method implementations: ``Lookup``, ``Get``, ``Put`` and
``Release`` here, the same-host RPCs from ``service_shm``, the admin ones from
``service_admin``, the call wrapper and request checks from ``service_calls``
(``Limits`` is re-exported from there); ``service_handlers`` registers them with gRPC.
Logic lives in ``TieredStore``; this module only validates request limits, maps errors
and records metrics. It never answers a malformed request with ``INTERNAL``: the status
names the field (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import grpc
import numpy as np

from kvstore.core import wire
from kvstore.core.types import ChunkRecord, NotFound
from kvstore.rpc.pb import pb
from kvstore.server.auth import Caller, tag_namespace
from kvstore.server.part_buffers import PartBuffers
from kvstore.server.service_admin import AdminRpcs
from kvstore.server.service_calls import Abort, Limits
from kvstore.server.service_handlers import Malformed
from kvstore.server.service_shm import ShmRpcs

__all__ = ["KVStoreService", "Limits"]


class KVStoreService(ShmRpcs, AdminRpcs):
    def Lookup(self, request, context):
        def run(caller: Caller):
            ttl = self._ttl(request.lease_ttl_s)
            if ttl:
                self.quotas.check_leases(caller.client)
            reserve = None
            if request.reserve_ttl_s:
                reserve = (request.holder or caller.client, self._reserve_ttl(request))
            # handles only where GetShm would give them; elsewhere the lookup just has none
            shm = request.shm and self._shm_offered(context)
            res = self.store.lookup(self._keys(request.keys), ttl, caller.tag, reserve, shm)
            if res.lease_id:
                self.quotas.lease_taken(caller.client, res.lease_id, ttl)
            grant = res.shm
            return pb.LookupResponse(
                matched=res.matched,
                tiers=res.tiers,
                lease_id=res.lease_id or 0,
                pending=res.pending,
                reserved=res.reserved,
                handles=[pb.ShmHandle(region=r, offset=o, length=n) for r, o, n in grant.handles]
                if grant
                else [],
                lease_ttl_s=grant.lease_ttl_s if grant else 0.0,
            )

        return self._call("Lookup", context, run)

    def Get(self, request, context) -> Iterator[bytes]:
        # A stream cannot abort once it started, so validate, and read or lease the
        # chunks, first; the call is timed until its last message is sent.
        def run(caller: Caller):
            keys = self._keys(request.keys)
            stream = self.quotas.stream(caller.client)
            stream.__enter__()
            try:
                # a lease as long as the call may last keeps the slots read below from reuse
                ttl = min(self.limits.max_lease_ttl_s, context.time_remaining() + 1.0)
                lease_id, payloads = self.store.get_shm(keys, ttl, views=True, owner=caller.tag)
            except BaseException:
                stream.__exit__(None, None, None)
                raise
            return self._encode(keys, payloads, lease_id, stream)

        return self._call("Get", context, run, stream=True)

    def _encode(
        self, keys: list[bytes], payloads: list, lease_id: int | None, stream
    ) -> Iterator[bytes]:
        """Chunk messages made one at a time, each with one copy out of its DRAM slot.

        Copying every payload up front (under the store's lock) held the whole answer in
        memory and kept the wire idle meanwhile; this copies each chunk while the one
        before is on its way, then ends the lease that kept the slots from reuse.
        """
        try:
            for key, payload in zip(keys, payloads):
                yield wire.encode_chunk(key, payload)
        finally:
            stream.__exit__(None, None, None)
            if lease_id is not None:
                with contextlib.suppress(NotFound):  # expired: the call outlived its deadline
                    self.store.release(lease_id)

    def Put(self, request_iterator, context):
        def run(caller: Caller):
            with self.quotas.stream(caller.client):
                return put(caller)

        def put(caller: Caller):
            totals = _PutTotals()
            parts: _Parts | None = None
            try:
                for message in request_iterator:
                    if isinstance(message, Malformed):
                        raise _malformed(message.error)
                    if message.part is not None:
                        if parts is None:
                            raise _malformed("a payload part with no chunk sent in parts before it")
                        self._wire("in", message.part.nbytes)
                        if parts.add(message.part):
                            done, parts = parts, None
                            try:
                                totals.add(self.store.put([done.record()], owner=caller.tag))
                            finally:
                                done.release()
                    if not message.records:
                        continue
                    if parts is not None:
                        raise _malformed(parts.unfinished())
                    records = self._check_put(message.records, caller, message.total_length)
                    if message.total_length:
                        *records, last = records
                        quota = self.quotas.inflight(caller.client, message.total_length)
                        parts = _Parts(last, message.total_length, quota, self.part_buffers)
                    nbytes = sum(memoryview(r.payload).nbytes for r in records)
                    self._wire("in", nbytes + (parts.filled if parts is not None else 0))
                    if records:
                        with self.quotas.inflight(caller.client, nbytes):
                            totals.add(self.store.put(records, owner=caller.tag))
                if parts is not None:
                    raise _malformed(parts.unfinished())
            finally:
                if parts is not None:
                    parts.release()
            # chunks the store refused are counted by the store, under fixed codes
            return pb.PutResponse(
                stored=totals.stored,
                duplicates=totals.duplicates,
                rejected=[pb.Rejected(key=k, reason=r) for k, r in totals.rejected],
            )

        return self._call("Put", context, run)

    def _check_put(
        self, records: list[ChunkRecord], caller: Caller, total_length: int = 0
    ) -> list[ChunkRecord]:
        """``records`` checked and tagged; with ``total_length``, the last one's payload
        is only the first part of that many bytes, and the limits apply to the whole."""
        self._keys([r.key for r in records])
        for i, r in enumerate(records):
            size = memoryview(r.payload).nbytes
            if total_length and i == len(records) - 1:  # the parser checked it is larger
                size = total_length
            if size > self.limits.max_chunk_bytes:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"chunk {r.key.hex()} is {size} bytes; max_chunk_bytes is "
                    f"{self.limits.max_chunk_bytes}",
                    "too_large",
                )
            if r.parent is not None and len(r.parent) != 16:
                raise Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"parent of {r.key.hex()} is {len(r.parent)} bytes; keys are 16 bytes",
                    "invalid_argument",
                )
            if r.parent is None and len(r.ns) != 32:
                raise Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk {r.key.hex()} starts a chain, so it needs a 32-byte namespace "
                    f"digest (got {len(r.ns)} bytes)",
                    "invalid_argument",
                )
        if caller.tag is None:
            return records
        return [
            r if r.parent is not None else dataclasses.replace(r, ns=tag_namespace(caller, r.ns))
            for r in records
        ]

    def Release(self, request, context):
        def run(caller: Caller):
            self.store.release(request.lease_id)
            self.quotas.lease_ended(caller.client, request.lease_id)
            return pb.ReleaseResponse()

        return self._call("Release", context, run)


def _malformed(error: str) -> Abort:
    return Abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"malformed PutRequest: {error}", "invalid_argument"
    )


class _PutTotals:
    """What a Put stream's store batches stored, found stored and refused, added up."""

    def __init__(self) -> None:
        self.stored = self.duplicates = 0
        self.rejected: list[tuple[bytes, str]] = []

    def add(self, result) -> None:
        self.stored += result.stored
        self.duplicates += result.duplicates
        self.rejected += result.rejected


class _Parts:
    """One chunk whose payload arrives in parts, copied into one buffer as they come.

    gRPC's Python server turns each received message into one ``bytes`` with the GIL held
    (a 32 MiB chunk in one message held lookups up for tens of ms); parts keep each
    message small. The buffer comes from the service's ``PartBuffers`` (``part_buffers``:
    anonymous memory in 4 KiB pages, not zeroed by us, reused from chunk to chunk so its
    pages are faulted in once), and ``np.copyto`` lets the GIL go while it copies. The
    client's in-flight byte quota covers the whole payload from its first part until
    ``release``, which gives the buffer back.
    """

    def __init__(self, head: ChunkRecord, total: int, quota, buffers: PartBuffers) -> None:
        self.head, self.total, self.quota, self.buffers = head, total, quota, buffers
        quota.__enter__()  # refuses (QuotaExceeded) before a byte is allocated
        try:
            self.lent = buffers.take(total)
        except BaseException:
            quota.__exit__(None, None, None)
            raise
        self.buf = self.lent.array
        self.filled = 0
        self.add(memoryview(head.payload))

    def add(self, part: memoryview) -> bool:
        """Append ``part``; True once the payload is whole."""
        n = part.nbytes
        if self.filled + n > self.total:
            raise _malformed(
                f"the parts of chunk {self.head.key.hex()} add up to more than its "
                f"total_length of {self.total} bytes"
            )
        np.copyto(self.buf[self.filled : self.filled + n], np.frombuffer(part, np.uint8))
        self.filled += n
        return self.filled == self.total

    def release(self) -> None:
        """Give the buffer back for the next chunk, and its bytes to the client's in-flight
        quota; once only. Nothing may hold the payload after this: the store copied what it
        kept."""
        if self.buf is None:
            return
        self.buf = None
        self.buffers.give(self.lent)
        self.quota.__exit__(None, None, None)

    def record(self) -> ChunkRecord:
        return dataclasses.replace(self.head, payload=memoryview(self.buf))

    def unfinished(self) -> str:
        return (
            f"chunk {self.head.key.hex()}'s payload ended after {self.filled} of its "
            f"total_length of {self.total} bytes"
        )
