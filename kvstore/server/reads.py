"""The store's read paths: ``get``, ``get_shm`` and ``peek``, with promotion of hits.

Offers the ``ReadPaths`` mixin of ``TieredStore`` (it uses the store's index, tiers,
locks and counters), ``ShmRef`` and the key-check helpers both halves share. A read
pins what it copies under the index lock, copies with no lock held, and always
unpins; it never takes the writer lock except to promote hits, and then only if
no writer is busy. It never fails because promotion did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.core.types import KEY_BYTES, ChunkKey, ChunkRecord, KVStoreError, check_key
from kvstore.server.index import Node

log = logging.getLogger("kvstore.server.store")


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a same-host reader finds a chunk: a shared-memory region and a slot in it."""

    region: str
    offset: int
    length: int


def owned_chain(nodes: list[Node], owner: bytes | None) -> list[Node]:
    """``nodes`` (a matched chain) if ``owner`` may see them: a chain has one namespace."""
    if owner is None or not nodes or nodes[0].ns[: len(owner)] == owner:
        return nodes
    return []


def check_keys(keys: Sequence[ChunkKey]) -> None:
    # The common case (all bytes, all 16 long) is two passes at C speed, which matters
    # on 512-key lookups; otherwise check_key names the first bad key.
    if set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}:
        for k in keys:
            check_key(k)


class ReadPaths:
    def get(self, keys: Sequence[ChunkKey], owner: bytes | None = None) -> list[bytes | bytearray]:
        """Payloads of the longest stored prefix of ``keys``, in order.

        The chunks are pinned under the index lock and copied outside it (the
        persistent tier's in one batch); lower-tier hits are then promoted to
        the top tier unless a writer is busy. A chunk that turns out corrupt
        ends the prefix and is dropped with its suffixes; pins never outlive
        the call, whatever fails.
        """
        check_keys(keys)
        with self._lock:
            nodes = owned_chain(self.index.match(keys), owner)
            self.index.touch(nodes)
            where = self.index.top_tiers(nodes)
            for node in nodes:
                node.leases += 1
            if len(nodes) < len(keys):
                self._stats.misses += 1
        out: list[bytes | bytearray | None] = [None] * len(nodes)
        try:
            deferred = [i for i, t in enumerate(where) if self.tiers[t].persistent]
            for i, (node, t) in enumerate(zip(nodes, where)):
                if not self.tiers[t].persistent:
                    (view,) = self.tiers[t].read([node.key])
                    out[i] = bytearray(view) if view is not None else None
            if deferred:
                payloads = self.tiers[self.last].read([nodes[i].key for i in deferred])
                for i, payload in zip(deferred, payloads, strict=True):
                    out[i] = payload
        finally:
            with self._lock:
                for node in nodes:
                    node.leases -= 1
                self._mover.collect_garbage()
        return self._finish_get(nodes, where, out)

    def _finish_get(self, nodes: list[Node], where: list[int], out: list) -> list:
        result: list[bytes | bytearray] = []
        corrupt: Node | None = None
        with self._lock:
            for node, t, payload in zip(nodes, where, out):
                if payload is None:
                    # gone from that tier since it was matched (evicted, deleted) or corrupt
                    if self.index.get(node.key) is node and node.in_tier(t):
                        self._tstats[t].corrupt += 1
                        corrupt = node
                    break
                result.append(payload)
                self._count_hit(t, payload)
        if corrupt is not None:
            with self._wlock:
                self._mover.drop_subtree(corrupt.key, "corrupt or missing value")
        lower = [(n, p) for n, t, p in zip(nodes, where, result) if t > 0]
        if lower and self._wlock.acquire(blocking=False):
            try:
                self._promote(lower)
            except KVStoreError as exc:  # the bytes were read; promotion is only an optimisation
                log.debug("promotion stopped: %s", exc)
            finally:
                self._wlock.release()
        return result

    def get_shm(
        self,
        keys: Sequence[ChunkKey],
        lease_ttl_s: float,
        *,
        views: bool = False,
        owner: bytes | None = None,
    ) -> tuple[int | None, list[ShmRef | memoryview | bytes | bytearray | None]]:
        """For same-host readers: the longest stored prefix under a new lease.

        Chunks the shared-memory tier holds in one piece come back as ``ShmRef``
        (valid while the lease lasts); the others as ``None``, unread: the reader
        fetches them over the wire (reading them here too would read them twice).
        With ``views`` every chunk comes back as bytes: shared-memory ones as
        read-only views, equally valid while the lease lasts (the service streams
        them out with no copy of its own), the rest read and then promoted.
        """
        check_keys(keys)
        shm_tier = self._shm_tier()
        with self._lock:
            nodes = owned_chain(self.index.match(keys), owner)
            self.index.touch(nodes)
            if len(nodes) < len(keys):
                self._stats.misses += 1
            if not nodes:
                return None, []
            lease_id = self.index.lease(nodes, lease_ttl_s)
            refs: list = []
            for node in nodes:
                ref = self._shm_ref(shm_tier, node)
                if ref is not None and views:
                    ref = self.tiers[shm_tier].read([node.key])[0]
                refs.append(ref)
        missing = [i for i, ref in enumerate(refs) if ref is None]
        if missing and views:
            payloads = self.get([n.key for n in nodes[: missing[-1] + 1]], owner)
            for i in missing:
                if i >= len(payloads):
                    refs = refs[:i]
                    break
                refs[i] = payloads[i]
        return lease_id, refs

    def _shm_tier(self) -> int | None:
        """The tier whose slots lie in shared memory, if any."""
        return next((t for t, tier in enumerate(self.tiers) if hasattr(tier, "region_name")), None)

    def _shm_ref(self, shm_tier: int | None, node: Node) -> ShmRef | None:
        """Where ``node``'s chunk lies in shared memory, counted as a hit; None if it is
        not there in one piece. Lock held; valid while a lease holds the node."""
        if shm_tier is None or not node.in_tier(shm_tier):
            return None
        tier = self.tiers[shm_tier]
        handle = tier.slot_handle(node.key)
        if handle is None:
            return None
        self._count_hit(shm_tier, handle[1])
        return ShmRef(tier.region_name, handle[0], handle[1])

    def _leading_shm_refs(self, nodes: Sequence[Node]) -> list[ShmRef]:
        """The leading ``nodes`` shared memory holds, as handed to a leased lookup."""
        shm_tier, refs = self._shm_tier(), []
        for node in nodes:
            ref = self._shm_ref(shm_tier, node)
            if ref is None:
                break
            refs.append(ref)
        return refs

    def _promote(self, hits: list[tuple[Node, bytes | bytearray]]) -> None:
        """Copy read hits into the top tier (writer lock held); raises what stops it."""
        top = self.tiers[0]
        for node, payload in hits:
            cost = top.cost(len(payload))
            with self._lock:
                if self.index.get(node.key) is not node or node.in_tier(0):
                    continue
                if cost > top.capacity_bytes:
                    continue
                plan = self.index.plan_eviction(0, cost)
            if plan is None:
                return
            self._mover.execute(plan)
            parent = node.parent.key if node.parent else None
            top.write([ChunkRecord(node.key, parent, node.ns, payload)])
            with self._lock:
                if self.index.get(node.key) is node:
                    self.index.add(node.key, None, node.ns, node.size, 0)
                    self._tstats[0].promotions_in += 1
                    continue
            top.delete([node.key])

    def _count_hit(self, tier: int, payload: bytes | bytearray | int | None) -> None:
        if payload is not None:
            ts = self._tstats[tier]
            ts.hits += 1
            ts.bytes_out += payload if isinstance(payload, int) else len(payload)

    def peek(
        self, keys: Sequence[ChunkKey], owner: bytes | None = None
    ) -> tuple[list[str], tuple[str, float, str] | None]:
        """Tiers of the stored prefix and the removal record of the first missing key.

        Read-only: no recency update, no counters (for ``explain``).
        """
        with self._lock:
            nodes = owned_chain(self.index.match(keys), owner)
            if owner is not None and not nodes:
                return [], None  # another tenant's removals are not this caller's business
            tiers = [self.tiers[t].name for t in self.index.top_tiers(nodes)]
            gone = self.index.why_missing(keys[len(nodes)]) if len(nodes) < len(keys) else None
            return tiers, gone
