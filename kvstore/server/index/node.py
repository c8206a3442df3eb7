"""One radix-tree node per chunk, and the intrusive per-tier recency lists.

Offers ``Node`` and ``RecencyList`` (push to the newest end, unlink, iterate
oldest first). The links live in the node's own slots so a million chunks cost
no extra objects: at most ``MAX_TIERS`` tiers. No locks of its own: in the store it is
only ever touched under the index lock.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_TIERS = 3


class Node:
    """A chunk: its key, parent, children, tiers it lives in (bitmask), size, leases.

    ``children`` is ``None``, a single ``Node`` or a dict key -> Node: most
    chains do not branch, and a one-entry dict costs more than the node itself.
    """

    __slots__ = (
        "key",
        "parent",
        "children",
        "tiers",
        "size",
        "ns",
        "leases",
        "p0",
        "n0",
        "p1",
        "n1",
        "p2",
        "n2",
    )

    def __init__(self, key: bytes | None, parent: Node | None, ns: bytes, size: int) -> None:
        self.key = key
        self.parent = parent
        self.children: Node | dict[bytes, Node] | None = None
        self.tiers = 0
        self.size = size
        self.ns = ns
        self.leases = 0
        self.p0 = self.n0 = self.p1 = self.n1 = self.p2 = self.n2 = None

    def iter_children(self) -> Iterator[Node]:
        c = self.children
        if c is None:
            return iter(())
        if isinstance(c, Node):
            return iter((c,))
        return iter(list(c.values()))

    def add_child(self, child: Node) -> None:
        c = self.children
        if c is None:
            self.children = child
        elif isinstance(c, Node):
            self.children = {c.key: c, child.key: child}
        else:
            c[child.key] = child

    def remove_child(self, child: Node) -> None:
        c = self.children
        if c is child:
            self.children = None
        elif isinstance(c, dict):
            c.pop(child.key, None)
            if len(c) == 1:
                self.children = next(iter(c.values()))

    def in_tier(self, tier: int) -> bool:
        return bool(self.tiers >> tier & 1)

    def __repr__(self) -> str:
        key = self.key.hex()[:8] if self.key else "root"
        return f"Node({key}, tiers={self.tiers:b}, leases={self.leases})"


class RecencyList:
    """A doubly linked list threaded through the nodes' ``p{i}``/``n{i}`` slots."""

    __slots__ = ("_p", "_n", "head", "count")

    def __init__(self, tier: int) -> None:
        self._p, self._n = f"p{tier}", f"n{tier}"
        self.head = Node(None, None, b"", 0)
        setattr(self.head, self._p, self.head)
        setattr(self.head, self._n, self.head)
        self.count = 0

    def push_newest(self, node: Node) -> None:
        p, n, head = self._p, self._n, self.head
        last = getattr(head, p)
        setattr(node, p, last)
        setattr(node, n, head)
        setattr(last, n, node)
        setattr(head, p, node)
        self.count += 1

    def unlink(self, node: Node) -> None:
        p, n = self._p, self._n
        before, after = getattr(node, p), getattr(node, n)
        setattr(before, n, after)
        setattr(after, p, before)
        setattr(node, p, None)
        setattr(node, n, None)
        self.count -= 1

    def move_to_newest(self, seq: list[Node]) -> None:
        """Make ``seq`` (oldest first, all in the list) the newest run of the list.

        A chain looked up again mostly still lies in the list as one run, or a few
        (a shared prefix another chain moved): each maximal run is spliced to the
        newest end whole, so a 512-chunk lookup relinks a handful of nodes, not 512.
        A run already at the newest end stays put.
        """
        n = self._n
        start = 0
        for i in range(1, len(seq)):
            if getattr(seq[i - 1], n) is not seq[i]:
                self._splice_newest(seq[start], seq[i - 1])
                start = i
        if seq:
            self._splice_newest(seq[start], seq[-1])

    def _splice_newest(self, first: Node, last: Node) -> None:
        """Move the run ``first`` .. ``last`` (linked, in list order) to the newest end."""
        p, n, head = self._p, self._n, self.head
        after = getattr(last, n)
        if after is head:
            return
        before = getattr(first, p)
        setattr(before, n, after)
        setattr(after, p, before)
        tail = getattr(head, p)
        setattr(tail, n, first)
        setattr(first, p, tail)
        setattr(last, n, head)
        setattr(head, p, last)

    def oldest_first(self) -> Iterator[Node]:
        n, head = self._n, self.head
        node = getattr(head, n)
        while node is not head:
            nxt = getattr(node, n)
            yield node
            node = nxt
