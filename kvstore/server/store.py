"""TieredStore: the index plus an ordered chain of tiers. Thread-safe.

Offers ``put``, ``lookup`` (optionally with a lease), ``release``, ``delete``,
``delete_namespace``, ``stats``, ``flush`` and ``close``; the reads (``get``,
``get_shm``, ``peek``) come from ``kvstore.server.reads``, same-host puts
(``reserve_shm``, ``commit_shm``) from ``kvstore.server.shm_puts``.

Writes land in the top tier and, under ``write_through``, also in the last
persistent tier before ``put`` returns; ``write_back`` persists only on
demotion and at ``flush``/``close``; ``none`` never writes behind (demotion
still moves evicted bytes down). A persistent last tier rebuilds the index at
start. A corrupted value read from a tier is dropped, counted, and never
returned.

Two locks. The index lock guards bookkeeping only and is never held while bytes
are copied, compressed or committed: ``lookup`` takes nothing else, so it never
waits on I/O. The writer lock lets one writer at a time (put, eviction,
promotion, delete, flush) move bytes; readers pin the chunks they copy so no
writer frees them mid-copy. Lock order: writer, then index.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence

from kvstore.core.lanes import spread
from kvstore.core.types import (
    ChunkKey,
    ChunkRecord,
    KVStoreError,
    LookupResult,
    NotFound,
    PutResult,
    ShmGrant,
    TierFullError,
    check_ns,
)
from kvstore.server.index import Node, RadixIndex, TierSpec
from kvstore.server.index.reservations import Reservations
from kvstore.server.mover import Mover
from kvstore.server.put_checks import validate_record
from kvstore.server.reads import ReadPaths, check_keys, owned_chain
from kvstore.server.shm_puts import SameHostPuts
from kvstore.server.stats import StoreStats, TierStats
from kvstore.server.tiers.base import Tier

log = logging.getLogger(__name__)
WRITE_POLICIES = ("write_through", "write_back", "none")


class TieredStore(ReadPaths, SameHostPuts):
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        max_chunk_bytes: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if any(t.persistent for t in tiers[:-1]):
            raise ValueError("only the last tier may be persistent")
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.max_chunk_bytes = max_chunk_bytes
        specs = [TierSpec(t.name, t.capacity_bytes, t.cost) for t in tiers]
        kwargs = {"clock": clock} if clock is not None else {}
        self.index = RadixIndex(
            specs,
            policy=eviction_policy,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            **kwargs,
        )
        self.last = len(tiers) - 1
        self._persist = tiers[-1].persistent and len(tiers) > 1 and write_policy != "none"
        self._lock = threading.RLock()  # the index: bookkeeping only
        self._reservations = Reservations(**kwargs)
        self._shm_puts_init()
        self._wlock = threading.Lock()  # one writer moves bytes at a time
        self._tstats = [TierStats(t.name, t.capacity_bytes) for t in tiers]
        self._mover = Mover(self.index, self.tiers, self._tstats, self._lock)
        self._stats = StoreStats(tiers=self._tstats, write_policy=write_policy)
        if tiers[-1].persistent:
            self._rebuild()

    # ---- start -------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Rebuild the index from the persistent tier, parents before children."""
        tier = self.tiers[-1]
        by_parent: dict[bytes | None, list] = {}
        for chunk in tier.scan():
            by_parent.setdefault(chunk.parent, []).append(chunk)
        frontier = by_parent.pop(None, [])
        while frontier:
            nxt = []
            for chunk in frontier:
                self.index.add(chunk.key, chunk.parent, chunk.ns, chunk.size, self.last)
                nxt.extend(by_parent.pop(chunk.key, []))
            frontier = nxt
        orphans = [c.key for chunks in by_parent.values() for c in chunks]
        if orphans:
            log.warning("dropping %d stored chunks whose prefix is gone", len(orphans))
            tier.delete(orphans)
        log.info("rebuilt index from %s: %d chunks", tier.name, len(self.index))

    # ---- writes --------------------------------------------------------------------

    def put(
        self,
        records: Sequence[ChunkRecord],
        owner: bytes | None = None,
        *,
        checked: bool = False,
        persisted: frozenset[bytes] = frozenset(),
        ticket: int | None = None,
    ) -> PutResult:
        """Store a batch of chunks, parents before children.

        Per-chunk problems (a parent that is not stored, a bad payload, no room
        in any tier) reject that chunk and its descendants in the batch; the
        result says which. Chunks admitted before a tier filled up are still
        written through. Under ``write_through`` a chunk counts as stored only
        once it is persisted; one that could not be (disk full, read-only) is
        rejected as "not persisted" though it stays cached in memory. When no
        chunk of the batch was stored, the cause is raised (``TierFullError``
        for lack of room).

        The put process's commits (``commit_shm``) pass ``checked`` (it verified the
        payloads' checksums already) and ``persisted`` (the keys it wrote to the last
        tier itself, which write-through then records instead of writing again). A key
        the put process has claimed is waited for (``wait_unclaimed``), and refused
        (``in_flight``) to every put but the commit of that ``ticket`` if the claim
        outlasts the wait: two writers of one LMDB key could leave one's bytes under the
        other's namespace.
        """
        if checked:
            limit = self.max_chunk_bytes
            verdicts = [(r, validate_record(r, limit, checksum=False)) for r in records]
        else:  # checksums run without the GIL: a large batch is checked on several cores
            verdicts = spread(
                [functools.partial(self._validate, r) for r in records],
                [memoryview(r.payload).nbytes for r in records],
            )
        if self._claims and ticket is None:
            self.wait_unclaimed([r.key for r in records])
        stored = dups = 0
        rejected: list[tuple[ChunkKey, str]] = []
        rejected_keys: set[bytes] = set()
        new: list[ChunkRecord] = []
        full: TierFullError | None = None
        with self._wlock:
            if self._tickets:
                self._lapse_tickets()
            with self._lock:
                self._expire()
                self._stats.puts += 1
            for rec, err in verdicts:
                if err is None and self._claims.get(rec.key, ticket) != ticket:
                    err = ("in_flight", "the put process is storing this chunk right now")
                with self._lock:
                    if err is None and rec.parent is not None and rec.parent in rejected_keys:
                        err = ("parent_rejected", "parent was rejected")
                    parent = self.index.get(rec.parent) if err is None and rec.parent else None
                    if parent is not None and not owned_chain([parent], owner):
                        parent = None  # another tenant's chunk: as good as absent
                    if err is None and rec.parent is not None and parent is None:
                        err = ("parent_not_stored", "parent is not stored")
                    node = self.index.get(rec.key) if err is None else None
                    if node is not None and not owned_chain([node], owner):
                        err, node = ("key_conflict", "the key is stored in another namespace"), None
                    if node is not None:
                        self.index.touch([node])
                if err is not None:
                    rejected.append((rec.key, err[1]))
                    rejected_keys.add(rec.key)
                    self.count_rejected(err[0])
                    continue
                if node is not None:
                    dups += 1
                    continue
                if parent is not None and rec.ns != parent.ns:
                    rec = dataclasses.replace(rec, ns=parent.ns)  # a chain has one namespace
                try:
                    self._mover.admit(rec)
                except TierFullError as exc:
                    full = exc
                    rejected.append((rec.key, f"tiers full: {exc}"))
                    rejected_keys.add(rec.key)
                    self.count_rejected("tiers_full")
                    continue
                new.append(rec)
                stored += 1
            if self.writes_through():
                lost, why = self._write_behind(new, persisted)
                for rec in new:
                    if rec.key in lost:  # cached above, but not acknowledged as stored
                        rejected.append((rec.key, f"not persisted: {why}"))
                        stored -= 1
                full = why if lost else full
            with self._lock:
                self._stats.put_chunks += stored
                self._stats.put_duplicates += dups
                self._reservations.stored(r.key for r in records)
        if full is not None and stored == 0 and dups == 0:
            raise full
        return PutResult(stored, dups, rejected)

    def writes_through(self) -> bool:
        """Whether a put persists its chunks in the last tier before it returns (and so
        whether the put process writes them there itself)."""
        return self._persist and self.write_policy == "write_through" and self.last > 0

    def _validate(self, rec: ChunkRecord) -> tuple[ChunkRecord, tuple[str, str] | None]:
        return rec, validate_record(rec, self.max_chunk_bytes)

    def count_rejected(self, code: str, n: int = 1) -> None:
        """Count ``n`` chunks refused under a short, fixed code (a metrics label, so never
        free text): by ``put`` here, or by the put process before they reached the store."""
        with self._lock:
            self._stats.rejected[code] = self._stats.rejected.get(code, 0) + n

    def _write_behind(
        self, records: list[ChunkRecord], persisted: frozenset[bytes] = frozenset()
    ) -> tuple[set[bytes], KVStoreError | None]:
        """Persist freshly admitted chunks (write_through), keeping the last tier prefix-closed.

        Returns the keys that could not be persisted and why: when the batch does not
        fit whole, the longest prefix that fits is persisted, chunk by chunk. Keys in
        ``persisted`` that the last tier really holds are only recorded there.
        """
        if persisted:
            persisted = frozenset(self.tiers[self.last].holding(sorted(persisted)))
        plan: list[ChunkRecord | Node] = []
        there: list[ChunkRecord] = []  # written by the put process: to record, not write
        seen: set[bytes] = set()
        with self._lock:
            for rec in records:
                node = self.index.get(rec.key)
                if node is None or node.in_tier(self.last):
                    continue
                for anc in self.index.missing_ancestors(node, self.last):
                    if anc.key not in seen and anc.key not in persisted:
                        seen.add(anc.key)
                        plan.append(anc)
                seen.add(rec.key)
                (there if rec.key in persisted else plan).append(rec)
        if not plan and not there:
            return set(), None
        lost, why = self._copy_behind(
            [self._mover.record_of(x) if isinstance(x, Node) else x for x in plan]
        )
        with self._lock:
            for rec in there:  # parents first: a parent that could not be persisted ...
                parent = self.index.get(rec.parent) if rec.parent is not None else None
                if rec.parent is not None and (parent is None or not parent.in_tier(self.last)):
                    lost.add(rec.key)  # ... leaves its children out of the last tier too
                    continue
                size = memoryview(rec.payload).nbytes
                self.index.add(rec.key, rec.parent, rec.ns, size, self.last)
                self._tstats[self.last].bytes_in += size
        if lost and why is None:
            why = KVStoreError("a parent chunk could not be persisted")
        return lost, why

    def _copy_behind(self, batch: list[ChunkRecord]) -> tuple[set[bytes], KVStoreError | None]:
        if not batch:
            return set(), None
        try:
            self._mover.copy_records(batch, self.last)
            return set(), None
        except TierFullError:
            pass
        except KVStoreError as exc:  # a read-only or failing disk: nothing of the batch
            return self._not_persisted(batch, exc)
        for i, rec in enumerate(batch):
            try:
                self._mover.copy_records([rec], self.last)
            except KVStoreError as exc:
                return self._not_persisted(batch[i:], exc)
        return set(), None

    def _not_persisted(
        self, batch: list[ChunkRecord], exc: KVStoreError
    ) -> tuple[set[bytes], KVStoreError]:
        log.warning("write-through failed for %d chunks: %s", len(batch), exc)
        self.count_rejected(
            "write_through_full" if isinstance(exc, TierFullError) else "write_failed"
        )
        return {r.key for r in batch}, exc

    # ---- reads ---------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[ChunkKey],
        lease_ttl_s: float | None = None,
        owner: bytes | None = None,
        reserve: tuple[str, float] | None = None,
        shm: bool = False,
    ) -> LookupResult:
        """Longest stored prefix of ``keys``; with a ttl, a lease keeps it from eviction,
        and with ``shm`` too, the leading leased chunks shared memory holds come back as
        a ``ShmGrant`` (``sent`` 0: the caller knows when it asked), counted as hits.

        With ``owner`` (a tenant's namespace tag, here and below), chains in other
        tenants' namespaces read as misses. With ``reserve`` (holder, ttl), the
        missing rest is reserved to the holder unless another producer's
        reservation leads it (then it is reported pending: single-flight prefill).
        """
        check_keys(keys)
        with self._lock:
            self._expire()
            nodes = owned_chain(self.index.match(keys), owner)
            self.index.touch(nodes)
            names = [self.tiers[t].name for t in self.index.top_tiers(nodes)]
            lease_id = self.index.lease(nodes, lease_ttl_s) if lease_ttl_s and nodes else None
            grant = None
            if shm and lease_id is not None:
                refs = tuple((r.region, r.offset, r.length) for r in self._leading_shm_refs(nodes))
                grant = ShmGrant(lease_id, lease_ttl_s, 0.0, refs) if refs else None
            self._stats.lookups += 1
            self._stats.lookup_keys += len(keys)
            self._stats.lookup_hit_keys += len(nodes)
            pending = reserved = 0
            if reserve is not None and len(nodes) < len(keys):
                if owner is not None:  # reservations are per tenant, like the chunks
                    reserve = (owner.hex() + "/" + reserve[0], reserve[1])
                rest = keys[len(nodes) :]
                pending, reserved = self._reservations.claim(rest, *reserve)
        return LookupResult(len(nodes), names, lease_id, pending, reserved, grant)

    def lease_expired(self, lease_id: int) -> bool:
        with self._lock:
            self._expire()
            return lease_id in self.index.expired_leases

    def release(self, lease_id: int) -> None:
        with self._lock:
            self.index.release(lease_id)
            self._mover.collect_garbage()

    # ---- deletion, stats, lifecycle -----------------------------------------------

    def delete(self, keys: Sequence[ChunkKey], owner: bytes | None = None) -> int:
        """Delete chunks and everything stored after them; returns chunks removed."""
        check_keys(keys)
        with self._wlock:
            with self._lock:
                if owner is not None:
                    keys = [k for k in keys if (n := self.index.get(k)) and owned_chain([n], owner)]
                removed = self.index.delete(keys)
            self._mover.free(removed)
        return len(removed)

    def delete_namespace(self, ns: bytes) -> int:
        check_ns(ns)
        with self._wlock:
            with self._lock:
                if ns not in self.index.namespaces():
                    raise NotFound(f"namespace {ns.hex()} has no stored chunks")
                removed = self.index.delete_namespace(ns)
            self._mover.free(removed)
        return len(removed)

    def _expire(self) -> None:
        self.index.expire_leases()
        self._mover.collect_garbage()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            for t, ts in enumerate(self._tstats):
                ts.used_bytes = self.index.used[t]
                ts.chunks = self.index.counts[t]
                ts.corrupt = max(ts.corrupt, getattr(self.tiers[t], "corrupt_count", 0))
            s = self._stats
            s.chunks = len(self.index)
            s.active_leases = self.index.active_leases
            s.reservations = self._reservations.active
            s.expired_leases = len(self.index.expired_leases)
            s.namespaces = {ns.hex(): n for ns, n in self.index.namespaces().items()}
            return copy.deepcopy(s)

    def flush(self) -> None:
        """Persist every chunk that only upper tiers hold (write_back and shutdown)."""
        if not self.tiers[-1].persistent or self.last == 0:
            return
        with self._wlock:
            with self._lock:
                pending = [n for n in self._tree_order() if not n.in_tier(self.last)]
            if pending:
                self._mover.copy_down(pending, self.last)

    def _tree_order(self) -> list[Node]:
        roots = [n for n in self.index.nodes() if n.parent is None]
        order: list[Node] = []
        while roots:
            node = roots.pop()
            order.append(node)
            roots.extend(node.iter_children())
        return order

    def close(self) -> None:
        if self.write_policy == "write_back":
            self.flush()
        with self._wlock, self._lock:
            self._mover.collect_garbage(force=True)
            for tier in self.tiers:
                tier.close()
