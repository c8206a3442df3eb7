"""Byte movement between tiers, as the index decides it. Called under the store's lock.

Offers ``Mover`` with ``admit(record)`` (into the fastest tier that can make room),
``execute(plan)`` (an eviction plan: copy, then update the index, then free),
``copy_records``/``copy_down``/``record_of`` (writes into a given tier, keeping the
last tier prefix-closed), ``drop_subtree``, and ``free``/``collect_garbage``
(shared-memory slots a lease still protects are freed when it ends).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.index import EvictionPlan, Node, RadixIndex
from kvstore.stats import TierStats
from kvstore.tiers.base import Tier
from kvstore.types import ChunkRecord, InvalidArgument, KVStoreError, TierFullError


class Mover:
    def __init__(self, index: RadixIndex, tiers: Sequence[Tier], tstats: list[TierStats]) -> None:
        self.index = index
        self.tiers = list(tiers)
        self.tstats = tstats
        self.last = len(self.tiers) - 1
        self._leased_garbage: list[tuple[Node, int]] = []  # (node, tier)

    def admit(self, rec: ChunkRecord) -> None:
        """Write one new chunk into the fastest tier that can make room for it."""
        size = memoryview(rec.payload).nbytes
        for t, tier in enumerate(self.tiers):
            if size > getattr(tier, "slot_bytes", size):
                continue
            if t == self.last and rec.parent is not None:
                parent = self.index.get(rec.parent)
                if parent is not None and not parent.in_tier(t):
                    self.copy_down(self.index.missing_ancestors(parent, t) + [parent], t)
            keep = [rec.parent] if rec.parent is not None else []
            plan = self.index.plan_eviction(t, tier.cost(size), keep)
            if plan is None:
                continue
            self.execute(plan)
            try:
                tier.write([rec])
            except (TierFullError, InvalidArgument):
                continue
            self.index.add(rec.key, rec.parent, rec.ns, size, t)
            self.tstats[t].bytes_in += size
            return
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
        tier = self.tiers[dst]
        total = sum(tier.cost(memoryview(r.payload).nbytes) for r in records)
        keep = [r.parent for r in records if r.parent is not None]
        plan = self.index.plan_eviction(dst, total, keep)
        if plan is None:
            raise TierFullError(f"{tier.name} cannot make room for {total} bytes")
        self.execute(plan)
        tier.write(records)
        for r in records:
            size = memoryview(r.payload).nbytes
            self.index.add(r.key, r.parent, r.ns, size, dst)
            self.tstats[dst].bytes_in += size

    def execute(self, plan: EvictionPlan) -> None:
        """Move bytes as planned: copy first, then update the index, then free."""
        for step in plan.steps:
            node = step.node
            if self.index.get(node.key) is not node:
                continue  # removed by an earlier step that found its bytes corrupt
            if step.dst is not None and not node.in_tier(step.dst):
                (payload,) = self.tiers[step.src].read([node.key])
                if payload is None:
                    self.tstats[step.src].corrupt += 1
                    self.drop_subtree(node.key, "corrupt")
                    continue
                parent = node.parent.key if node.parent else None
                self.tiers[step.dst].write([ChunkRecord(node.key, parent, node.ns, payload)])
                self.tstats[step.dst].demotions_in += 1
            self.index.apply(step)
            if not step.keep_src:
                self.tiers[step.src].delete([node.key])
                self.tstats[step.src].evictions += 1

    def drop_subtree(self, key: bytes, reason: str) -> None:
        self.free(self.index.delete([key], reason=reason))

    def free(self, removed: list[tuple[Node, int]]) -> None:
        """Free the bytes of removed nodes; shared-memory slots under a lease wait.

        Same-host readers copy straight out of DRAM slots under a lease, so such
        a slot must not be reused until that lease is released or expires.
        Other tiers are read under the store's lock or in a transaction.
        """
        for t, tier in enumerate(self.tiers):
            shared = hasattr(tier, "region_name")
            keys = []
            for node, mask in removed:
                if mask >> t & 1:
                    if shared and node.leases:
                        self._leased_garbage.append((node, t))
                        self.index.charge(t, tier.cost(node.size))
                    else:
                        keys.append(node.key)
            if keys:
                tier.delete(keys)

    def collect_garbage(self, force: bool = False) -> None:
        """Free deleted slots whose last lease has ended (called under the lock)."""
        if not self._leased_garbage:
            return
        keep = []
        for node, t in self._leased_garbage:
            if node.leases and not force:
                keep.append((node, t))
                continue
            self.index.charge(t, -self.tiers[t].cost(node.size))
            if self.index.get(node.key) is None:  # not stored again since
                self.tiers[t].delete([node.key])
        self._leased_garbage = keep
