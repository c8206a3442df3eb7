"""Counters the store keeps, as plain records (``TierStats``, ``StoreStats``).

Data only: no locks, no I/O; ``TieredStore.stats`` hands out a copy, never the live ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    corrupt: int = 0


@dataclass(slots=True)
class StoreStats:
    tiers: list[TierStats]
    chunks: int = 0
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hit_keys: int = 0
    misses: int = 0
    puts: int = 0
    put_chunks: int = 0
    put_duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    active_leases: int = 0
    expired_leases: int = 0
    reservations: int = 0  # chunks reserved to a producer (single-flight prefill)
    namespaces: dict[str, int] = field(default_factory=dict)
    write_policy: str = ""
