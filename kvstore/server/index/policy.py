"""Eviction policies: tiny strategy objects chosen by name from ``POLICIES``.

A policy says whether an access refreshes a node's place in a tier's recency
list; eviction always takes candidates from the oldest end. A policy never picks a
victim itself, so it can never evict a leased chunk.
"""

from __future__ import annotations

from typing import ClassVar


class EvictionPolicy:
    name: ClassVar[str]
    refresh_on_access: ClassVar[bool]


class LruPolicy(EvictionPolicy):
    """Least recently used goes first."""

    name = "lru"
    refresh_on_access = True


class FifoPolicy(EvictionPolicy):
    """First stored goes first, however often it is read."""

    name = "fifo"
    refresh_on_access = False


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, FifoPolicy)}
