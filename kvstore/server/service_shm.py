"""The servicer's same-host shared-memory RPCs: ``GetShm``, ``ReserveShm``, ``CommitShm``.

Offers the ``ShmRpcs`` mixin of ``KVStoreService``. These calls
hand out handles into the store's DRAM region, so they never answer a peer that is not
on the store's own host (loopback or a Unix socket), nor any peer when ``server.shm`` is
off: such a client is told to use ``Get`` or ``Put`` instead.
"""

from __future__ import annotations

import contextlib

import grpc

from kvstore.core.types import NotFound
from kvstore.rpc.pb import pb
from kvstore.server.auth import Caller, tag_namespace
from kvstore.server.reads import ShmRef
from kvstore.server.service_calls import Abort, ServiceCalls, is_local


class ShmRpcs(ServiceCalls):
    def GetShm(self, request, context):
        """All handles in one message: a streamed message each costs more than its copy."""

        def run(caller: Caller):
            self._shm_allowed(context, instead="Get")
            keys = self._keys(request.keys)
            ttl = self._ttl(request.lease_ttl_s) or self.limits.default_lease_ttl_s
            self.quotas.check_leases(caller.client)
            lease_id, refs = self.store.get_shm(keys, ttl, owner=caller.tag)
            handles = []
            for ref in refs:
                if not isinstance(ref, ShmRef):
                    break
                handles.append(
                    pb.ShmHandle(region=ref.region, offset=ref.offset, length=ref.length)
                )
            if lease_id is not None and not handles:
                # the lease id travels with handles only: with none, no client could release it
                with contextlib.suppress(NotFound):  # it may have lapsed while bytes were read
                    self.store.release(lease_id)
                lease_id = None
            if lease_id is not None:
                self.quotas.lease_taken(caller.client, lease_id, ttl)
            return pb.ShmBatch(
                matched=len(refs),
                lease_id=lease_id or 0,
                handles=handles,
                lease_ttl_s=ttl if lease_id else 0.0,
            )

        return self._call("GetShm", context, run)

    def ReserveShm(self, request, context):
        def run(caller: Caller):
            self._shm_allowed(context, instead="Put")
            chunks = [
                (bytes(c.key), bytes(c.parent) or None, bytes(c.namespace), c.length)
                for c in request.chunks
            ]
            self._keys([c[0] for c in chunks])
            chunks = [
                (k, p, tag_namespace(caller, ns) if p is None and len(ns) == 32 else ns, n)
                for k, p, ns, n in chunks
            ]
            ttl = self._ttl(request.ttl_s) or self.limits.default_lease_ttl_s
            ticket, refs, stored = self.store.reserve_shm(chunks, ttl, owner=caller.tag)
            handles = [
                pb.ShmHandle(region=r.region, offset=r.offset, length=r.length)
                if r is not None
                else pb.ShmHandle()
                for r in refs
            ]
            return pb.ShmReservation(
                ticket=ticket or 0, handles=handles, stored=stored, ttl_s=ttl if ticket else 0.0
            )

        return self._call("ReserveShm", context, run)

    def CommitShm(self, request, context):
        def run(caller: Caller):
            self._shm_allowed(context, instead="Put")
            result = self.store.commit_shm(request.ticket, owner=caller.tag)
            return pb.PutResponse(
                stored=result.stored,
                duplicates=result.duplicates,
                rejected=[pb.Rejected(key=k, reason=r) for k, r in result.rejected],
            )

        return self._call("CommitShm", context, run)

    def _shm_offered(self, context) -> bool:
        """Whether this caller may be handed shared-memory handles."""
        return self.limits.shm and is_local(context.peer())

    def _shm_allowed(self, context, instead: str) -> None:
        if not self.limits.shm:
            raise Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server does not offer shared memory (server.shm=false); use {instead}",
                "shm_disabled",
            )
        if not is_local(context.peer()):
            raise Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shared memory is only for clients on the store's own host; use {instead}",
                "shm_not_local",
            )
