"""Same-host puts: a client on the store's host writes a chunk straight into the DRAM
region and commits it, instead of sending its bytes over a socket.

Offers the ``SameHostPuts`` mixin of ``TieredStore``: ``reserve_shm(chunks, ttl_s)``
(room in the shared-memory tier, made by the usual eviction, with the key written
before each payload) and ``commit_shm(ticket)`` (the filled room goes through exactly
the validation and admission of ``put`` and is published in place, with no copy).
Room that is never committed lapses after its ttl. Never publishes a chunk whose
payload fails ``put``'s checks: such room is simply given back.

The put process (``kvstore.server.put_process``) uses the same two calls with more
trust: its reservations (``worker`` set) also take room in the last tier and claim
their keys, since it writes them to LMDB itself before it commits (``persisted``) and
has checked their checksums (``checked``). Its room never lapses by time: it is given
back by ``abort_shm`` or, when that process died, by ``reclaim_worker``, which also
deletes what it wrote to the last tier for chunks never committed. Another put of a
claimed key waits for the claim to end (then is refused if it has not), so one LMDB key
never has two writers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.core.types import (
    ChunkRecord,
    InvalidArgument,
    NotFound,
    PutResult,
    TierFullError,
    check_key,
)
from kvstore.server.reads import ShmRef, owned_chain

ShmChunk = tuple[bytes, bytes | None, bytes, int]  # key, parent, namespace, length
CLAIM_WAIT_S = 10.0  # a put waits this long for the put process to finish a key it claims


@dataclass
class _Ticket:
    expiry: float
    chunks: list[ShmChunk]
    owner: bytes | None
    charged: int
    worker: int | None = None  # the put process's generation, for its reservations
    charged_last: int = 0  # room held in the last tier for what that process persists


class SameHostPuts:
    def _shm_puts_init(self) -> None:
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        self._claims: dict[bytes, int] = {}  # key -> the put process's ticket writing it
        self._unclaimed = threading.Condition()  # notified whenever claims end

    def reserve_shm(
        self,
        chunks: Sequence[ShmChunk],
        ttl_s: float,
        owner: bytes | None = None,
        worker: int | None = None,
    ) -> tuple[int | None, list[ShmRef | None], list[bool]]:
        """Room for each chunk: ``(ticket, refs, stored)``; a ``None`` ref got no room
        (``stored`` says whether that is because the store holds it already). For the
        put process (``worker``), a key the index knows in any namespace, or another
        writer has room for, gets no room: its ordinary put decides."""
        refs: list[ShmRef | None] = []
        stored: list[bool] = []
        tier = self.tiers[0]
        if not hasattr(tier, "stage"):
            return None, [None] * len(chunks), [False] * len(chunks)
        for key, parent, _, _ in chunks:  # all checked before any room is taken
            check_key(key)
            if parent is not None:
                check_key(parent, "parent")
        staged: list[ShmChunk] = []
        charged = 0
        with self._wlock:
            self._lapse_tickets()
            persist = worker is not None and self.writes_through()
            last: list[int] = []
            try:
                charged = self._stage_all(chunks, owner, staged, refs, stored, worker, last)
            except BaseException:
                # an eviction that failed midway: the room staged so far goes back
                tier.unstage([c[0] for c in staged])
                with self._lock:
                    self.index.charge(0, -sum(tier.cost(c[3]) for c in staged))
                    if last:
                        self.index.charge(self.last, -sum(last))
                raise
            if not staged:
                return None, refs, stored
            ticket = next(self._ticket_ids)
            expiry = self.index.clock() + ttl_s if worker is None else float("inf")
            t = _Ticket(expiry, staged, owner, charged, worker, sum(last))
            self._tickets[ticket] = t
            if persist:
                self._claims.update((c[0], ticket) for c in staged)
        return ticket, refs, stored

    def _stage_all(
        self,
        chunks: Sequence[ShmChunk],
        owner: bytes | None,
        staged: list[ShmChunk],
        refs: list[ShmRef | None],
        stored: list[bool],
        worker: int | None = None,
        last: list[int] | None = None,
    ) -> int:
        """Room for each chunk that is not stored yet (writer lock held); appends to
        ``staged``, ``refs`` and ``stored`` as it goes, returns the bytes charged. For
        the put process under write-through, room in the last tier too (appended to
        ``last``): it writes there before the index counts the bytes."""
        tier = self.tiers[0]
        charged = 0
        persist = worker is not None and self.writes_through()
        keep = [c[1] for c in chunks if c[1] is not None]  # parents stay where they are
        chain_ns: dict[bytes, bytes] = {}  # staged here: key -> its chain's namespace
        for key, parent, ns, length in chunks:
            with self._lock:
                node = self.index.get(key)
                held = node is not None and bool(owned_chain([node], owner))
            refs.append(None)
            stored.append(held)
            too_big = self.max_chunk_bytes is not None and length > self.max_chunk_bytes
            if held or too_big:
                continue
            if worker is not None:
                # The put process writes LMDB before the commit's checks, and a store that
                # dies in between rebuilds from LMDB: room only for a chunk nobody else
                # writes, under a parent of this owner's (stored, or staged just before).
                chain = self._chain_ns(key, parent, ns, owner, chain_ns)
                if node is not None or key in self._claims or chain is None:
                    continue
                ns = chain
            cost = tier.cost(length)
            with self._lock:
                plan = self.index.plan_eviction(0, cost)
            if plan is None:
                continue
            self._mover.execute(plan)
            try:
                where = tier.stage(key, length)
            except (TierFullError, InvalidArgument):
                where = None
            if where is None:
                continue
            try:
                room_below = not persist or self._room_below(length, last, keep)
            except BaseException:
                tier.unstage([key])
                raise
            if not room_below:
                tier.unstage([key])
                continue
            with self._lock:
                self.index.charge(0, cost)  # room nobody else may take meanwhile
            charged += cost
            staged.append((key, parent, ns, length))
            chain_ns[key] = ns
            refs[-1] = ShmRef(tier.region_name, *where)
        return charged

    def _chain_ns(
        self,
        key: bytes,
        parent: bytes | None,
        ns: bytes,
        owner: bytes | None,
        staged: dict[bytes, bytes],
    ) -> bytes | None:
        """The namespace ``key`` is stored under: its own as a chain's first chunk, else
        its parent's, when that parent is staged in this batch or stored for ``owner``;
        None when it is neither (index lock taken here)."""
        if parent is None:
            return ns
        if parent in staged:
            return staged[parent]
        with self._lock:
            node = self.index.get(parent)
            if node is None or not owned_chain([node], owner):
                return None
            return node.ns

    def reserved_namespaces(self, ticket: int) -> dict[bytes, bytes]:
        """Each reserved chunk's chain namespace, which the put process writes to LMDB."""
        with self._wlock:
            t = self._tickets.get(ticket)
            return {} if t is None else {c[0]: c[2] for c in t.chunks}

    def _room_below(self, length: int, last: list[int], keep: Sequence[bytes] = ()) -> bool:
        """Make and hold room in the last tier for ``length`` bytes (writer lock held)."""
        cost = self.tiers[self.last].cost(length)
        with self._lock:
            plan = self.index.plan_eviction(self.last, cost, keep)
        if plan is None:
            return False
        self._mover.execute(plan)
        with self._lock:
            self.index.charge(self.last, cost)
        last.append(cost)
        return True

    def commit_shm(
        self,
        ticket: int,
        owner: bytes | None = None,
        *,
        worker: int | None = None,
        persisted: Sequence[bytes] = (),
    ) -> PutResult:
        """Publish what the writer put in its room, validated and admitted like ``put``.
        From the put process (``worker``), the checksums were checked there and the keys
        in ``persisted`` are in the last tier already."""
        tier = self.tiers[0]
        with self._wlock:
            self._lapse_tickets()
            t = self._tickets.get(ticket)
            if t is None or t.owner != owner or t.worker != worker:
                raise NotFound(f"reservation {ticket} is unknown or lapsed: put the chunks again")
            del self._tickets[ticket]
            records = [
                ChunkRecord(key, parent, ns, tier.staged_view(key))
                for key, parent, ns, _ in t.chunks
            ]
            with self._lock:
                self.index.charge(0, -t.charged)
        mine = frozenset(r.key for r in records)
        try:
            if worker is None:
                return self.put(records, owner)
            return self.put(
                records,
                owner,
                checked=True,
                persisted=frozenset(persisted) & mine,
                ticket=ticket,
            )
        finally:
            with self._wlock:
                tier.unstage([r.key for r in records])  # whatever put did not publish
                if worker is not None:
                    # held until put recorded the chunks there: LMDB holds them already,
                    # and counting them twice for a moment is safe where none would not be
                    with self._lock:
                        self.index.charge(self.last, -t.charged_last)
                    self._unclaim(ticket, [k for k in persisted if k in mine])

    def abort_shm(self, ticket: int, worker: int, written: Sequence[bytes] = ()) -> None:
        """The put process gives a reservation up; ``written`` were written to the last
        tier already and are deleted there again."""
        with self._wlock:
            t = self._tickets.get(ticket)
            if t is None or t.worker != worker:
                raise NotFound(f"reservation {ticket} is unknown")
            self._give_back(ticket, written)

    def reclaim_worker(self, worker: int) -> int:
        """After the put process of that generation died: give back all its room, and
        delete from the last tier what it may have written for chunks never committed.
        Returns the reservations reclaimed."""
        with self._wlock:
            mine = [i for i, t in self._tickets.items() if t.worker == worker]
            for ticket in mine:
                self._give_back(ticket, [c[0] for c in self._tickets[ticket].chunks])
        return len(mine)

    def _give_back(self, ticket: int, written: Sequence[bytes]) -> None:
        """Drop a reservation: its room, its last-tier charge, its claims (writer lock held)."""
        t = self._tickets.pop(ticket)
        self.tiers[0].unstage([c[0] for c in t.chunks])
        with self._lock:
            self.index.charge(0, -t.charged)
            if t.charged_last:
                self.index.charge(self.last, -t.charged_last)
        self._unclaim(ticket, written)

    def _unclaim(self, ticket: int, written: Sequence[bytes]) -> None:
        """End a ticket's claims; first delete from the last tier what it wrote there that
        the index does not record there (refused, or lost its parent). Writer lock held."""
        with self._lock:
            stray = [
                k
                for k in written
                if self._claims.get(k) == ticket
                and ((n := self.index.get(k)) is None or not n.in_tier(self.last))
            ]
        if stray:
            self.tiers[self.last].delete(stray)
        for key in [k for k, t in self._claims.items() if t == ticket]:
            del self._claims[key]
        with self._unclaimed:
            self._unclaimed.notify_all()

    def wait_unclaimed(self, keys: Sequence[bytes], timeout_s: float = CLAIM_WAIT_S) -> None:
        """Wait (up to ``timeout_s``) until the put process no longer claims any of
        ``keys``: a put of a prefix it is storing right now then finds it stored, instead
        of being refused (two requests sharing a system prompt, say)."""
        deadline = time.monotonic() + timeout_s
        with self._unclaimed:
            while any(k in self._claims for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._unclaimed.wait(left)

    def _lapse_tickets(self) -> None:
        """Give back the room of reservations nobody committed in time (writer lock held)."""
        now = self.index.clock()
        for ticket in [i for i, t in self._tickets.items() if t.expiry <= now]:
            self._give_back(ticket, ())
