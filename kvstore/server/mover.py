"""Byte movement between tiers, as the index decides it.

Offers ``Mover`` with ``admit(record)`` (into the fastest tier that can make room),
``execute(plan)`` (an eviction plan: copy, then update the index, then free),
``copy_records``/``copy_down``/``record_of`` (writes into a given tier, keeping the
last tier prefix-closed), ``drop_subtree``, and ``free``/``collect_garbage``
(memory the readers of a deleted chunk still hold is freed when their lease ends).

Called by the one writer at a time (the store's writer lock). Never holds the
index lock while bytes move: it takes that lock only to plan and to record
what was done, so lookups wait for bookkeeping, never for a copy, a compression
or an LMDB commit. Between those steps the index is consistent: a chunk is
recorded in a tier only after its bytes are there, and its bytes are freed only
after the index stopped naming them and no lease holds them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.core.types import ChunkRecord, InvalidArgument, KVStoreError, TierFullError
from kvstore.server.index import EvictionPlan, Node, RadixIndex, Step
from kvstore.server.stats import TierStats
from kvstore.server.tiers.base import Tier


class Mover:
    def __init__(
        self,
        index: RadixIndex,
        tiers: Sequence[Tier],
        tstats: list[TierStats],
        lock: threading.RLock,
    ) -> None:
        self.index = index
        self.tiers = list(tiers)
        self.tstats = tstats
        self.last = len(self.tiers) - 1
        self._lock = lock  # the index lock
        # (node, tier, its room there): bytes of deleted chunks that readers still hold
        self._leased_garbage: list[tuple[Node, int, object]] = []

    def admit(self, rec: ChunkRecord) -> int:
        """Write one new chunk into the fastest tier that can make room; returns that tier."""
        size = memoryview(rec.payload).nbytes
        keep = [rec.parent] if rec.parent is not None else []
        for t, tier in enumerate(self.tiers):
            cost = tier.cost(size)
            if cost > tier.capacity_bytes:
                continue  # larger than the whole tier: the next one takes it
            if t == self.last and rec.parent is not None:
                with self._lock:
                    parent = self.index.get(rec.parent)
                    missing = []
                    if parent is not None and not parent.in_tier(t):
                        missing = self.index.missing_ancestors(parent, t) + [parent]
                if missing:
                    self.copy_down(missing, t)
            with self._lock:
                plan = self.index.plan_eviction(t, cost, keep)
            if plan is None:
                continue
            self.execute(plan)
            try:
                tier.write([rec])
            except (TierFullError, InvalidArgument):
                continue
            with self._lock:
                self.index.add(rec.key, rec.parent, rec.ns, size, t)
            self.tstats[t].bytes_in += size
            return t
        raise TierFullError(f"no tier can admit a chunk of {size} bytes; all are full or leased")

    def copy_down(self, nodes: list[Node], dst: int) -> None:
        self.copy_records([self.record_of(n) for n in nodes], dst)

    def record_of(self, node: Node) -> ChunkRecord:
        """A node's bytes, copied out of the fastest tier that holds them."""
        src = self.index.top_tier(node)
        (payload,) = self.tiers[src].read([node.key])
        if payload is None:
            raise KVStoreError(f"chunk {node.key.hex()} vanished from {self.tiers[src].name}")
        parent = node.parent.key if node.parent else None
        return ChunkRecord(node.key, parent, node.ns, bytearray(payload))

    def copy_records(self, records: list[ChunkRecord], dst: int) -> None:
        """Write chunks the index knows into tier ``dst`` (parents first), making room."""
        tier = self.tiers[dst]
        total = sum(tier.cost(memoryview(r.payload).nbytes) for r in records)
        keep = [r.parent for r in records if r.parent is not None]
        with self._lock:
            plan = self.index.plan_eviction(dst, total, keep)
        if plan is None:
            raise TierFullError(f"{tier.name} cannot make room for {total} bytes")
        self.execute(plan)
        tier.write(records)
        orphans = []
        with self._lock:
            for r in records:
                if self.index.get(r.key) is None:  # dropped as corrupt while we copied
                    orphans.append(r.key)
                    continue
                size = memoryview(r.payload).nbytes
                self.index.add(r.key, r.parent, r.ns, size, dst)
                self.tstats[dst].bytes_in += size
        if orphans:
            tier.delete(orphans)

    def execute(self, plan: EvictionPlan) -> None:
        """Move bytes as planned: copy first, then update the index, then free.

        A chunk a reader leased since the plan was made keeps its bytes where
        they are (it may gain a copy below); the tier then runs a little over
        its mark until the next eviction.
        """
        for step in plan.steps:
            node = step.node
            with self._lock:
                if self.index.get(node.key) is not node:
                    continue  # removed by an earlier step that found its bytes corrupt
                copy = step.dst is not None and not node.in_tier(step.dst)
            if copy:
                (payload,) = self.tiers[step.src].read([node.key])
                if payload is None:
                    self.tstats[step.src].corrupt += 1
                    self.drop_subtree(node.key, "corrupt")
                    continue
                parent = node.parent.key if node.parent else None
                self.tiers[step.dst].write([ChunkRecord(node.key, parent, node.ns, payload)])
                self.tstats[step.dst].demotions_in += 1
            with self._lock:
                keep = step.keep_src or node.leases > 0
                self.index.apply(Step(node, step.src, step.dst, keep_src=True) if keep else step)
            if not keep:
                self.tiers[step.src].delete([node.key])
                self.tstats[step.src].evictions += 1

    def drop_subtree(self, key: bytes, reason: str) -> None:
        with self._lock:
            removed = self.index.delete([key], reason=reason)
        self.free(removed)

    def free(self, removed: list[tuple[Node, int]]) -> None:
        """Free the bytes of nodes removed from the index; leased memory waits.

        Readers copy straight out of memory tiers under a lease (same-host
        readers from shared memory, the service from views), so such bytes must
        not be reused until that lease is released or expires. A persistent
        tier's readers read in their own transaction and need no such wait.
        """
        doomed: dict[int, list[bytes]] = {}
        with self._lock:
            for t, tier in enumerate(self.tiers):
                for node, mask in removed:
                    if not mask >> t & 1:
                        continue
                    if not tier.persistent and node.leases:
                        # Out of the tier's key map now, its room kept: the key may be
                        # stored again (in other room) before the lease ends, and that
                        # chunk's eviction must not free the bytes this reader holds.
                        held = tier.detach(node.key)
                        if held is not None:
                            self._leased_garbage.append((node, t, held))
                            self.index.charge(t, tier.cost(node.size))
                    else:
                        doomed.setdefault(t, []).append(node.key)
        for t, keys in doomed.items():
            self.tiers[t].delete(keys)

    def collect_garbage(self, force: bool = False) -> None:
        """Free deleted chunks whose last lease has ended (called under the index lock).

        Only memory tiers have such garbage, and freeing it is bookkeeping, no I/O.
        """
        if not self._leased_garbage:
            return
        keep = []
        for node, t, held in self._leased_garbage:
            if node.leases and not force:
                keep.append((node, t, held))
                continue
            self.index.charge(t, -self.tiers[t].cost(node.size))
            self.tiers[t].release(held)  # that room only, whatever holds the key now
        self._leased_garbage = keep
