"""Several stores as one: each key chain lives on one shard, chosen by rendezvous
(highest-random-weight) hashing of its root key. Client side; imports no server code.

Offers ``shard_targets(spec)`` (``"a:1,b:2"``, a list, or ``"dns:NAME:PORT"`` for
every address a name resolves to, as a Kubernetes headless Service gives),
``rendezvous(root, shards)`` and ``ShardedClient`` with the ``KVStoreClient`` calls
that name a chain (``lookup``, ``get``, ``get_shm_into``, ``put``, ``delete``,
``explain``, ``release``, ``release_later``) plus ``stats()`` (one answer per shard),
``wait_releases`` and ``close``;
``connect(spec, options)`` gives a plain client for one address and a sharded one
for several.

A lookup of one prefix asks one shard. Adding a shard moves about 1/N of the chains
(only those the new shard now wins). A shard that is down or slow turns its chains
into misses within the call's deadline: ``lookup``/``get`` answer "nothing stored"
instead of raising, so an engine recomputes; puts to it report their chunks as
rejected ("shard unavailable").
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence

import grpc
import xxhash

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.core.types import ChunkRecord, InvalidArgument, LookupResult, PutResult

_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_LEASE_SHIFT = 56  # a sharded lease id carries its shard's index above the store's id


def shard_targets(spec: str | Sequence[str]) -> list[str]:
    """The shard addresses a spec names, in a stable order."""
    if not isinstance(spec, str):
        targets = list(spec)
    elif spec.startswith("dns:"):
        host, _, port = spec[len("dns:") :].rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"a DNS shard spec is dns:NAME:PORT, got {spec!r}")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            raise InvalidArgument(f"cannot resolve {host}: {e}") from e
        ips = sorted({info[4][0] for info in infos})
        targets = [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]
    else:
        targets = [t.strip() for t in spec.split(",") if t.strip()]
    if not targets or len(set(targets)) != len(targets):
        raise InvalidArgument(f"shard addresses must be distinct and non-empty, got {spec!r}")
    return targets


def rendezvous(root: bytes, shards: Sequence[str]) -> int:
    """Index of the shard that holds the chain starting at ``root``."""
    return max(
        range(len(shards)), key=lambda i: xxhash.xxh3_64_intdigest(root + shards[i].encode())
    )


def connect(spec: str | Sequence[str], options: ClientOptions | None = None):
    """A ``KVStoreClient`` for one address, a ``ShardedClient`` for several."""
    targets = shard_targets(spec)
    if len(targets) == 1 and not (isinstance(spec, str) and spec.startswith("dns:")):
        return KVStoreClient(targets[0], options)
    return ShardedClient(targets, options)


class ShardedClient:
    def __init__(self, spec: str | Sequence[str], options: ClientOptions | None = None) -> None:
        self.targets = shard_targets(spec)
        self.shards = [KVStoreClient(t, options) for t in self.targets]

    def shard_of(self, root: bytes) -> int:
        return rendezvous(root, self.targets)

    def _for(self, keys: Sequence[bytes]) -> tuple[int, KVStoreClient | None]:
        if not keys:
            return 0, None
        i = self.shard_of(keys[0])
        return i, self.shards[i]

    def lookup(self, keys: Sequence[bytes], lease_ttl_s: float = 0.0, timeout_s=None, **kw):
        i, shard = self._for(keys)
        if shard is None:
            return LookupResult(0, [])
        try:
            res = shard.lookup(keys, lease_ttl_s, timeout_s, **kw)
        except ClientError as e:
            if e.code not in _DOWN:
                raise
            return LookupResult(0, [])  # a shard that is down: its chains are misses
        lease = res.lease_id + (i << _LEASE_SHIFT) if res.lease_id else None
        return LookupResult(res.matched, res.tiers, lease, res.pending, res.reserved)

    def release(self, lease_id: int, timeout_s: float | None = None) -> None:
        shard = self.shards[lease_id >> _LEASE_SHIFT]
        shard.release(lease_id & ((1 << _LEASE_SHIFT) - 1), timeout_s)

    def release_later(self, lease_id: int) -> None:
        shard = self.shards[lease_id >> _LEASE_SHIFT]
        shard.release_later(lease_id & ((1 << _LEASE_SHIFT) - 1))

    def wait_releases(self, timeout_s: float | None = None) -> bool:
        """Every shard's queued releases sent, all within one ``timeout_s``."""
        timeout_s = self.shards[0].options.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        return all([s.wait_releases(max(0.0, deadline - time.monotonic())) for s in self.shards])

    def get(self, keys: Sequence[bytes], **kw) -> list[memoryview]:
        _, shard = self._for(keys)
        try:
            return shard.get(keys, **kw) if shard else []
        except ClientError as e:
            if e.code not in _DOWN:
                raise
            return []

    def get_shm_into(self, keys: Sequence[bytes], dests: Sequence, timeout_s=None) -> int:
        _, shard = self._for(keys)
        try:
            return shard.get_shm_into(keys, dests, timeout_s) if shard else 0
        except ClientError as e:
            if e.code not in _DOWN:
                raise
            return 0

    def put(
        self,
        records: Sequence[ChunkRecord],
        timeout_s: float | None = None,
        root: bytes | Mapping[bytes, bytes] | None = None,
        *,
        shm: bool = False,
    ) -> PutResult:
        """Store chains, each on its root's shard. ``root`` names the chain of records
        that continue one stored earlier (their first parent is not in ``records``): one
        key for all, or each record's key mapped to its chain's root. ``shm`` as for
        ``KVStoreClient.put`` (same host only)."""
        groups: dict[int, list[ChunkRecord]] = {}
        root_of: dict[bytes, bytes] = {}
        for rec in records:
            if rec.parent is None:
                r = rec.key
            elif rec.parent in root_of:
                r = root_of[rec.parent]
            elif isinstance(root, Mapping) and rec.key in root:
                r = root[rec.key]
            elif isinstance(root, bytes):
                r = root
            else:
                raise InvalidArgument(
                    f"chunk {rec.key.hex()} continues a chain stored earlier: "
                    "pass root= (the chain's first key) to place it"
                )
            root_of[rec.key] = r
            groups.setdefault(self.shard_of(r), []).append(rec)
        stored = dups = 0
        rejected: list[tuple[bytes, str]] = []
        for i, batch in groups.items():
            try:
                res = self.shards[i].put(batch, timeout_s, shm=shm)
            except ClientError as e:
                if e.code not in _DOWN:
                    raise
                rejected += [(r.key, f"shard unavailable: {self.targets[i]}") for r in batch]
                continue
            stored, dups, rejected = (
                stored + res.stored,
                dups + res.duplicates,
                rejected + res.rejected,
            )
        return PutResult(stored, dups, rejected)

    def delete(self, keys: Sequence[bytes] = (), namespace: bytes | None = None, timeout_s=None):
        """Chunks by key (each on its chain's shard when it is a root, else asked of all),
        or a namespace on every shard."""
        removed = 0
        for shard in self.shards:
            try:
                removed += shard.delete(keys, namespace, timeout_s)
            except ClientError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
        return removed

    def explain(self, keys: Sequence[bytes], *args, **kw):
        _, shard = self._for(keys)
        if shard is None:
            raise InvalidArgument("name the keys to explain")
        return shard.explain(keys, *args, **kw)

    def stats(self, timeout_s: float | None = None) -> list:
        """``(target, StatsResponse or ClientError)`` for every shard."""
        out = []
        for target, shard in zip(self.targets, self.shards):
            try:
                out.append((target, shard.stats(timeout_s)))
            except ClientError as e:
                out.append((target, e))
        return out

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
