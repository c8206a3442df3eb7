"""The one interface every tier implements.

A tier moves bytes and nothing else: which chunk lives where, and what to evict,
is decided by the index (``kvstore.server.index``). Offers:

- ``write(records)``: store a batch; all or nothing; ``TierFullError`` when full.
- ``read(keys)``: a batch of payloads (``None`` for missing or corrupted values).
- ``delete(keys)``: drop a batch; unknown keys are ignored.
- ``cost(nbytes)``: the bytes of capacity one payload of ``nbytes`` occupies.
- ``capacity_bytes``, ``close()``.

Memory tiers (``persistent`` false; readers copy straight out of them under a lease)
also offer ``detach(key)`` (delete the key, keep its room: a handle, or None) and
``release(handle)`` (give that room back once the last reader is done).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.core.types import ChunkKey, ChunkRecord


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """What a persistent tier reports at start so the index can be rebuilt."""

    key: ChunkKey
    parent: ChunkKey | None
    ns: bytes
    size: int


@runtime_checkable
class Tier(Protocol):
    name: str
    capacity_bytes: int
    persistent: bool

    def cost(self, nbytes: int) -> int: ...

    def write(self, records: Sequence[ChunkRecord]) -> None: ...

    def read(self, keys: Sequence[ChunkKey]) -> list[bytes | memoryview | None]: ...

    def delete(self, keys: Sequence[ChunkKey]) -> None: ...

    def scan(self) -> Iterator[StoredChunk]: ...

    def close(self) -> None: ...
