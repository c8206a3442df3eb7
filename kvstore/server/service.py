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

from kvstore.core import wire
from kvstore.core.types import ChunkRecord, NotFound
from kvstore.rpc.pb import pb
from kvstore.server.auth import Caller, tag_namespace
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
            res = self.store.lookup(self._keys(request.keys), ttl, caller.tag, reserve)
            if res.lease_id:
                self.quotas.lease_taken(caller.client, res.lease_id, ttl)
            return pb.LookupResponse(
                matched=res.matched,
                tiers=res.tiers,
                lease_id=res.lease_id or 0,
                pending=res.pending,
                reserved=res.reserved,
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
            stored = dups = 0
            rejected = []
            for records in request_iterator:
                if isinstance(records, Malformed):
                    raise Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed PutRequest: {records.error}",
                        "invalid_argument",
                    )
                nbytes = sum(memoryview(r.payload).nbytes for r in records)
                self._wire("in", nbytes)
                records = self._check_put(records, caller)
                with self.quotas.inflight(caller.client, nbytes):
                    result = self.store.put(records, owner=caller.tag)
                stored += result.stored
                dups += result.duplicates
                rejected += result.rejected
            # chunks the store refused are counted by the store, under fixed codes
            return pb.PutResponse(
                stored=stored,
                duplicates=dups,
                rejected=[pb.Rejected(key=k, reason=r) for k, r in rejected],
            )

        return self._call("Put", context, run)

    def _check_put(self, records: list[ChunkRecord], caller: Caller) -> list[ChunkRecord]:
        self._keys([r.key for r in records])
        for r in records:
            size = memoryview(r.payload).nbytes
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
