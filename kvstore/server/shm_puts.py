"""Same-host puts: a client on the store's host writes a chunk straight into the DRAM
region and commits it, instead of sending its bytes over a socket.

Offers the ``SameHostPuts`` mixin of ``TieredStore``: ``reserve_shm(chunks, ttl_s)``
(room in the shared-memory tier, made by the usual eviction, with the key written
before each payload) and ``commit_shm(ticket)`` (the filled room goes through exactly
the validation and admission of ``put`` and is published in place, with no copy).
Room that is never committed lapses after its ttl. Never publishes a chunk whose
payload fails ``put``'s checks: such room is simply given back.
"""

from __future__ import annotations

import itertools
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


@dataclass
class _Ticket:
    expiry: float
    chunks: list[ShmChunk]
    owner: bytes | None
    charged: int


class SameHostPuts:
    def _shm_puts_init(self) -> None:
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)

    def reserve_shm(
        self, chunks: Sequence[ShmChunk], ttl_s: float, owner: bytes | None = None
    ) -> tuple[int | None, list[ShmRef | None], list[bool]]:
        """Room for each chunk: ``(ticket, refs, stored)``; a ``None`` ref got no room
        (``stored`` says whether that is because the store holds it already)."""
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
            try:
                charged = self._stage_all(chunks, owner, staged, refs, stored)
            except BaseException:
                # an eviction that failed midway: the room staged so far goes back
                tier.unstage([c[0] for c in staged])
                with self._lock:
                    self.index.charge(0, -sum(tier.cost(c[3]) for c in staged))
                raise
            if not staged:
                return None, refs, stored
            ticket = next(self._ticket_ids)
            self._tickets[ticket] = _Ticket(self.index.clock() + ttl_s, staged, owner, charged)
        return ticket, refs, stored

    def _stage_all(
        self,
        chunks: Sequence[ShmChunk],
        owner: bytes | None,
        staged: list[ShmChunk],
        refs: list[ShmRef | None],
        stored: list[bool],
    ) -> int:
        """Room for each chunk that is not stored yet (writer lock held); appends to
        ``staged``, ``refs`` and ``stored`` as it goes, returns the bytes charged."""
        tier = self.tiers[0]
        charged = 0
        for key, parent, ns, length in chunks:
            with self._lock:
                node = self.index.get(key)
                held = node is not None and bool(owned_chain([node], owner))
            refs.append(None)
            stored.append(held)
            too_big = self.max_chunk_bytes is not None and length > self.max_chunk_bytes
            if held or too_big:
                continue
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
            with self._lock:
                self.index.charge(0, cost)  # room nobody else may take meanwhile
            charged += cost
            staged.append((key, parent, ns, length))
            refs[-1] = ShmRef(tier.region_name, *where)
        return charged

    def commit_shm(self, ticket: int, owner: bytes | None = None) -> PutResult:
        """Publish what the writer put in its room, validated and admitted like ``put``."""
        tier = self.tiers[0]
        with self._wlock:
            self._lapse_tickets()
            t = self._tickets.get(ticket)
            if t is None or t.owner != owner:
                raise NotFound(f"reservation {ticket} is unknown or lapsed: put the chunks again")
            del self._tickets[ticket]
            records = [
                ChunkRecord(key, parent, ns, tier.staged_view(key))
                for key, parent, ns, _ in t.chunks
            ]
            with self._lock:
                self.index.charge(0, -t.charged)
        try:
            return self.put(records, owner)
        finally:
            with self._wlock:
                tier.unstage([r.key for r in records])  # whatever put did not publish

    def _lapse_tickets(self) -> None:
        """Give back the room of reservations nobody committed in time (writer lock held)."""
        now = self.index.clock()
        for ticket in [i for i, t in self._tickets.items() if t.expiry <= now]:
            t = self._tickets.pop(ticket)
            self.tiers[0].unstage([c[0] for c in t.chunks])
            with self._lock:
                self.index.charge(0, -t.charged)
