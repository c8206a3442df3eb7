"""The radix index: which chunk lives in which tier, and what to evict. No I/O.

Offers, on ``RadixIndex``:

- ``add(key, parent, ns, size, tier)`` / ``remove(key, tier)``: residency.
- ``match(keys)``: the longest prefix of a key chain present in some tier.
- ``touch(nodes)``: record an access (refreshes recency under LRU).
- ``lease(nodes, ttl_s)`` / ``release(lease_id)`` / ``expire_leases()``.
- ``plan_eviction(tier, incoming)``: an ``EvictionPlan`` that makes room, or
  ``None`` when no plan can, in which case nothing changed.
- ``missing_ancestors(node, tier)``: what must be copied first so the last tier
  stays prefix-closed.
- ``delete(keys)`` / ``delete_namespace(ns)``: drop chunks and their suffixes.
- ``why_missing(key)``: the eviction record of a key that is gone.

Invariants: a node's parent is always in the tree; the last tier is
prefix-closed (it never holds a suffix without its prefix) and drops leaves
only; upper tiers evict by demotion (the bytes move down); leased nodes are
never evicted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.core.types import InvalidArgument, NotFound
from kvstore.server.index.node import MAX_TIERS, Node, RecencyList
from kvstore.server.index.policy import POLICIES

EVICTION_LOG_SIZE = 65536
# the fastest tier in a residency bitmask (lowest set bit); -1 for none
_TOP_TIER = [(m & -m).bit_length() - 1 for m in range(1 << MAX_TIERS)]


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A tier as the index sees it: a name, a capacity and what one chunk costs."""

    name: str
    capacity_bytes: int
    cost_of: Callable[[int], int] | None = None  # the tier's own rounding; bytes as-is if None

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"tier {self.name}: capacity_bytes must be positive")

    def cost(self, size: int) -> int:
        return self.cost_of(size) if self.cost_of is not None else size


@dataclass(frozen=True, slots=True)
class Step:
    """Move ``node`` out of tier ``src``: copy to ``dst`` first unless ``dst`` is None.

    ``keep_src`` marks a copy that only makes the last tier prefix-closed.
    """

    node: Node
    src: int
    dst: int | None
    keep_src: bool = False


@dataclass(slots=True)
class EvictionPlan:
    """Steps in execution order: the deepest tier's room is made first."""

    steps: list[Step] = field(default_factory=list)
    freed: dict[int, int] = field(default_factory=dict)


class RadixIndex:
    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        policy: str = "lru",
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= len(tiers) <= MAX_TIERS:
            raise ValueError(f"between 1 and {MAX_TIERS} tiers, got {len(tiers)}")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; one of {sorted(POLICIES)}")
        self.tiers = list(tiers)
        self.policy = POLICIES[policy]()
        self.high, self.low = high_watermark, low_watermark
        self.clock = clock
        self.last = len(tiers) - 1
        self.used = [0] * len(tiers)
        self.counts = [0] * len(tiers)
        self._lists = [RecencyList(i) for i in range(len(tiers))]
        self._nodes: dict[bytes, Node] = {}
        self._ns: dict[bytes, list] = {}  # digest -> [interned digest, node count]
        self._sizes: dict[int, int] = {}
        self._leases: dict[int, tuple[float, list[Node]]] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self.expired_leases: OrderedDict[int, float] = OrderedDict()
        self.evictions = [0] * len(tiers)
        self._gone: OrderedDict[bytes, tuple[str, float, str]] = OrderedDict()

    # ---- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, key: bytes) -> Node | None:
        return self._nodes.get(key)

    def nodes(self) -> Iterable[Node]:
        return self._nodes.values()

    def namespaces(self) -> dict[bytes, int]:
        return {ns: entry[1] for ns, entry in self._ns.items()}

    def match(self, keys: Sequence[bytes]) -> list[Node]:
        """Nodes of the longest prefix of ``keys`` that is present, in order."""
        out: list[Node] = []
        parent = None
        for key in keys:
            node = self._nodes.get(key)
            if node is None or node.parent is not parent:
                break
            out.append(node)
            parent = node
        return out

    def top_tier(self, node: Node) -> int:
        """The fastest tier holding ``node``."""
        return _TOP_TIER[node.tiers]

    def top_tiers(self, nodes: Sequence[Node]) -> list[int]:
        """``top_tier`` of each of ``nodes`` (a 512-chunk lookup asks for all of them)."""
        top = _TOP_TIER
        return [top[n.tiers] for n in nodes]

    def why_missing(self, key: bytes) -> tuple[str, float, str] | None:
        """(tier, monotonic time, reason) of the last removal of ``key``, if remembered."""
        return self._gone.get(key)

    # ---- residency -------------------------------------------------------------

    def add(self, key: bytes, parent: bytes | None, ns: bytes, size: int, tier: int) -> Node:
        """Record that ``tier`` holds ``key``; creates the node on first sight.

        The caller has made room (``plan_eviction``). Raises ``NotFound`` when the
        parent is not in the tree: a suffix is never stored without its prefix.
        """
        node = self._nodes.get(key)
        if node is None:
            pnode = None
            if parent is not None:
                pnode = self._nodes.get(parent)
                if pnode is None:
                    raise NotFound(f"parent {parent.hex()} of {key.hex()} is not stored")
            elif ns not in self._ns:
                self._ns[ns] = [ns, 0]
            ns = pnode.ns if pnode is not None else self._ns[ns][0]
            node = Node(key, pnode, ns, self._sizes.setdefault(size, size))
            self._ns[ns][1] += 1
            self._nodes[key] = node
            if pnode is not None:
                pnode.add_child(node)
            self._gone.pop(key, None)
        elif parent is not None and (node.parent is None or node.parent.key != parent):
            raise InvalidArgument(f"key {key.hex()} is already stored under another parent")
        if node.in_tier(tier):
            self._refresh(node, tier)
            return node
        if tier == self.last and node.parent is not None and not node.parent.in_tier(tier):
            raise ValueError(f"{tier=}: parent of {key.hex()} must be stored there first")
        node.tiers |= 1 << tier
        self.used[tier] += self.tiers[tier].cost(node.size)
        self.counts[tier] += 1
        self._lists[tier].push_newest(node)
        return node

    def remove(self, key: bytes, tier: int, reason: str = "evicted") -> Node | None:
        """Forget that ``tier`` holds ``key``; a node left in no tier leaves the tree."""
        node = self._nodes.get(key)
        if node is None or not node.in_tier(tier):
            return None
        self._drop_residency(node, tier)
        if node.tiers == 0:
            if node.children is not None:
                raise ValueError(f"{key.hex()} still has children; remove them first")
            self._unlink(node, self.tiers[tier].name, reason)
        return node

    def _drop_residency(self, node: Node, tier: int) -> None:
        node.tiers &= ~(1 << tier)
        self.used[tier] -= self.tiers[tier].cost(node.size)
        self.counts[tier] -= 1
        self._lists[tier].unlink(node)

    def _unlink(self, node: Node, tier_name: str, reason: str) -> None:
        del self._nodes[node.key]
        if node.parent is not None:
            node.parent.remove_child(node)
        entry = self._ns[node.ns]
        entry[1] -= 1
        if entry[1] == 0:
            del self._ns[node.ns]
        self._gone[node.key] = (tier_name, self.clock(), reason)
        if len(self._gone) > EVICTION_LOG_SIZE:
            self._gone.popitem(last=False)

    def charge(self, tier: int, nbytes: int) -> None:
        """Count (or, negative, stop counting) bytes a tier holds outside the tree.

        Deleted chunks that readers still hold under a lease keep their slots.
        """
        self.used[tier] += nbytes

    def touch(self, nodes: Sequence[Node]) -> None:
        """Record an access to a chain, deepest first so parents end up newer.

        Keeping parents newer than their children lets the last tier find
        droppable leaves at the old end of its list.
        """
        if not self.policy.refresh_on_access or not nodes:
            return
        order = nodes[::-1]
        for t, lst in enumerate(self._lists):
            bit = 1 << t
            members = [n for n in order if n.tiers & bit]
            if members:
                lst.move_to_newest(members)

    def _refresh(self, node: Node, tier: int) -> None:
        if self.policy.refresh_on_access:
            lst = self._lists[tier]
            lst.unlink(node)
            lst.push_newest(node)

    def missing_ancestors(self, node: Node, tier: int) -> list[Node]:
        """Ancestors of ``node`` absent from ``tier``, root-most first."""
        out = []
        a = node.parent
        while a is not None and not a.in_tier(tier):
            out.append(a)
            a = a.parent
        out.reverse()
        return out

    # ---- leases ----------------------------------------------------------------

    def lease(self, nodes: Sequence[Node], ttl_s: float) -> int:
        if ttl_s <= 0:
            raise InvalidArgument(f"lease ttl must be positive, got {ttl_s}")
        lease_id = next(self._lease_ids)
        expiry = self.clock() + ttl_s
        held = list(nodes)
        for node in held:
            node.leases += 1
        self._leases[lease_id] = (expiry, held)
        heapq.heappush(self._lease_heap, (expiry, lease_id))
        return lease_id

    def release(self, lease_id: int) -> None:
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            if lease_id in self.expired_leases:
                raise NotFound(f"lease {lease_id} already expired")
            raise NotFound(f"lease {lease_id} is unknown")
        for node in entry[1]:
            node.leases -= 1

    def expire_leases(self) -> int:
        now = self.clock()
        expired = 0
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            entry = self._leases.pop(lease_id, None)
            if entry is None:
                continue
            for node in entry[1]:
                node.leases -= 1
            self.expired_leases[lease_id] = now
            if len(self.expired_leases) > EVICTION_LOG_SIZE:
                self.expired_leases.popitem(last=False)
            expired += 1
        return expired

    @property
    def active_leases(self) -> int:
        return len(self._leases)

    # ---- eviction ----------------------------------------------------------------

    def needs_room(self, tier: int, incoming: int) -> bool:
        return self.used[tier] + incoming > self.high * self.tiers[tier].capacity_bytes

    def plan_eviction(
        self, tier: int, incoming: int, keep: Sequence[bytes] = ()
    ) -> EvictionPlan | None:
        """Room for ``incoming`` more bytes in ``tier``, down to the low watermark.

        ``keep`` names chunks that must stay where they are (the parent of the
        chunk being admitted). Returns an empty plan when no eviction is needed,
        and ``None`` when even the least that admission needs cannot be freed
        (then nothing changed). Victims demote to the next tier, whose room is
        planned in turn.
        """
        plan = EvictionPlan()
        self.expire_leases()
        if not self.needs_room(tier, incoming):
            return plan
        protected = {n for k in keep if (n := self._nodes.get(k)) is not None}
        if not self._plan_tier(tier, incoming, plan, protected):
            return None
        return plan

    def _plan_tier(self, tier: int, incoming: int, plan: EvictionPlan, protected: set) -> bool:
        spec = self.tiers[tier]
        cap = spec.capacity_bytes
        want = self.used[tier] + incoming - int(self.low * cap)
        need = self.used[tier] + incoming - cap
        if want <= 0:
            return True
        freed = 0
        steps: list[Step] = []
        if tier == self.last:
            freed = self._plan_drops(tier, want, steps, protected)
        else:
            dst = tier + 1
            copied: set[Node] = set()
            moved = 0
            for node in self._lists[tier].oldest_first():
                if freed >= want:
                    break
                if node.leases or node in protected:
                    continue
                if node.in_tier(dst) or node in copied:
                    steps.append(Step(node, tier, None))
                else:
                    if dst == self.last:
                        for anc in self.missing_ancestors(node, dst):
                            if anc not in copied:
                                copied.add(anc)
                                moved += self.tiers[dst].cost(anc.size)
                                steps.append(Step(anc, self.top_tier(anc), dst, keep_src=True))
                    copied.add(node)
                    moved += self.tiers[dst].cost(node.size)
                    steps.append(Step(node, tier, dst))
                freed += spec.cost(node.size)
            if freed < need:
                return False
            victims = {s.node for s in steps}
            if (
                moved
                and self.needs_room(dst, moved)
                and not self._plan_tier(dst, moved, plan, protected | victims | copied)
            ):
                return False
        if freed < need:
            return False
        plan.steps.extend(steps)
        plan.freed[tier] = plan.freed.get(tier, 0) + freed
        return True

    def _plan_drops(self, tier: int, want: int, steps: list[Step], protected: set) -> int:
        """Leaves of the last tier, oldest first; a parent left childless follows at once.

        Following the parent up keeps one pass enough when chains were stored
        root first (so their roots are the oldest entries) and never read since.
        """
        spec = self.tiers[tier]
        dropped: set[Node] = set()
        freed = 0
        for node in self._lists[tier].oldest_first():
            if freed >= want:
                break
            while (
                node is not None
                and freed < want
                and node.in_tier(tier)
                and self._droppable(node, tier, dropped, protected)
            ):
                dropped.add(node)
                steps.append(Step(node, tier, None))
                freed += spec.cost(node.size)
                node = node.parent
        return freed

    def _droppable(self, node: Node, tier: int, dropped: set, protected: set) -> bool:
        if node in dropped or node.leases or node in protected:
            return False
        only_here = 1 << tier
        leaves_tree = node.tiers == only_here
        for child in node.iter_children():
            if child in protected:
                return False
            if leaves_tree:
                # the node leaves the tree, so each child must leave it too
                if child not in dropped or child.tiers != only_here:
                    return False
            elif child.in_tier(tier) and child not in dropped:
                return False
        return True

    def apply(self, step: Step) -> None:
        """Record one executed step: the bytes were copied and then removed."""
        node = step.node
        if step.dst is not None and not node.in_tier(step.dst):
            self.add(node.key, None, node.ns, node.size, step.dst)
        if not step.keep_src and node.in_tier(step.src):
            self.evictions[step.src] += 1
            self.remove(node.key, step.src, "demoted" if step.dst is not None else "evicted")

    # ---- deletion ----------------------------------------------------------------

    def delete(self, keys: Iterable[bytes], reason: str = "deleted") -> list[tuple[Node, int]]:
        """Remove chunks with every suffix stored under them: (node, tier mask) each.

        Leased nodes go too (deletion is explicit); their ``leases`` count tells
        the caller to keep the bytes until the readers are done.
        """
        removed: list[tuple[Node, int]] = []
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                self._delete_subtree(node, reason, removed)
        return removed

    def delete_namespace(self, ns: bytes) -> list[tuple[Node, int]]:
        if ns not in self._ns:
            return []
        roots = [n for n in self._nodes.values() if n.parent is None and n.ns == ns]
        return self.delete([n.key for n in roots], reason="namespace deleted")

    def _delete_subtree(self, root: Node, reason: str, out: list[tuple[Node, int]]) -> None:
        order: list[Node] = []
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.iter_children())
        for node in reversed(order):  # leaves first, so no node outlives its parent
            mask = node.tiers
            for t in range(len(self.tiers)):
                if mask >> t & 1:
                    self._drop_residency(node, t)
            self._unlink(node, "-", reason)
            out.append((node, mask))
