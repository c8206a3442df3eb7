"""The servicer's admin RPCs: ``Delete``, ``Stats``, ``Explain`` and ``Routes``.

Offers the ``AdminRpcs`` mixin of ``KVStoreService``. A tenant's call only ever reaches
or shows its own namespaces: a tenant's ``Stats`` hides the store-wide counters, and
``Explain`` never changes what it explains (no recency refreshed, no lease taken).
``Routes`` tells clients where to send their puts (``put_port``, the store's put process)
and same-host put calls (``local_socket``, ``kvstore.server.local_channel``).
"""

from __future__ import annotations

import time

import grpc

from kvstore.rpc.pb import pb
from kvstore.server.auth import Caller, owns, shown_namespace, tag_namespace
from kvstore.server.explain import explain
from kvstore.server.service_calls import Abort, ServiceCalls


def _slots(obj) -> dict:
    return {f: getattr(obj, f) for f in obj.__slots__}


class AdminRpcs(ServiceCalls):
    def Delete(self, request, context):
        def run(caller: Caller):
            keys = self._keys(request.keys)
            if not keys and not request.namespace:
                raise Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "name keys or a namespace to delete",
                    "invalid_argument",
                )
            removed = self.store.delete(keys, owner=caller.tag) if keys else 0
            if request.namespace:
                ns = tag_namespace(caller, bytes(request.namespace))
                removed += self.store.delete_namespace(ns)
            return pb.DeleteResponse(removed=removed)

        return self._call("Delete", context, run)

    def Stats(self, request, context):
        def run(caller: Caller):
            s = self.store.stats()
            from kvstore import __version__

            if caller.tag is not None and not caller.admin:
                return self._tenant_stats(caller, s, __version__)
            return pb.StatsResponse(
                tiers=[pb.TierStats(**_slots(t)) for t in s.tiers],
                chunks=s.chunks,
                lookups=s.lookups,
                lookup_keys=s.lookup_keys,
                lookup_hit_keys=s.lookup_hit_keys,
                put_chunks=s.put_chunks,
                put_duplicates=s.put_duplicates,
                rejected=s.rejected,
                active_leases=s.active_leases,
                expired_leases=s.expired_leases,
                reservations=s.reservations,
                namespaces=s.namespaces,
                write_policy=s.write_policy,
                version=__version__,
                uptime_s=time.monotonic() - self.started,
            )

        return self._call("Stats", context, run)

    def _tenant_stats(self, caller: Caller, s, version: str) -> pb.StatsResponse:
        """A tenant sees its own namespaces and chunk count; the rest is not its business."""
        mine = {
            shown_namespace(caller, ns): n
            for ns, n in s.namespaces.items()
            if owns(caller, bytes.fromhex(ns))
        }
        return pb.StatsResponse(
            chunks=sum(mine.values()),
            namespaces=mine,
            write_policy=s.write_policy,
            version=version,
            uptime_s=time.monotonic() - self.started,
        )

    def Explain(self, request, context):
        def run(caller: Caller):
            ns = bytes(request.namespace)
            e = explain(
                self.store,
                self._keys(request.keys),
                tag_namespace(caller, ns) if len(ns) == 32 else ns or None,
                request.lease_id or None,
                owner=caller.tag,
            )
            return pb.ExplainResponse(
                matched=e.matched,
                reason=e.reason,
                detail=e.detail,
                tier=e.tier or "",
                seconds_ago=e.seconds_ago or 0.0,
                tiers=e.tiers,
            )

        return self._call("Explain", context, run)

    def Routes(self, request, context):
        def run(caller: Caller):
            return pb.RoutesResponse(put_port=self.put_port or 0, local_socket=self.local_socket)

        return self._call("Routes", context, run)
