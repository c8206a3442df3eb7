"""Plain records shared by every layer. No I/O, no third-party imports.

Offers: ``ChunkKey`` (16 raw bytes), ``ChunkRecord`` (what a tier stores),
``LookupResult`` and ``PutResult`` (what the store and the client both answer),
``ShmGrant`` (shared-memory handles a leased lookup hands a same-host caller),
``KVStoreError`` and its subclasses, the error types every layer raises.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY_BYTES = 16
NS_BYTES = 32

ChunkKey = bytes


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class InvalidArgument(KVStoreError):
    """The caller's input is malformed (bad key, size, header)."""


class PayloadError(InvalidArgument):
    """A chunk payload failed validation (magic, version, shape, size, checksum)."""


class TierFullError(KVStoreError):
    """A tier cannot admit more bytes; nothing already stored was lost."""


class NotFound(KVStoreError):
    """A lease, key or namespace that the caller named does not exist."""


def check_key(key: object, what: str = "key") -> bytes:
    """Return ``key`` as bytes if it is a 16-byte chunk key, else raise InvalidArgument."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what} must be {KEY_BYTES} bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"{what} must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def check_ns(ns: object) -> bytes:
    """Return ``ns`` as bytes if it is a 32-byte namespace digest, else raise InvalidArgument."""
    if not isinstance(ns, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"namespace must be {NS_BYTES} bytes, got {type(ns).__name__}")
    ns = bytes(ns)
    if len(ns) != NS_BYTES:
        raise InvalidArgument(f"namespace must be {NS_BYTES} bytes, got {len(ns)}")
    return ns


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk as a tier stores it.

    ``parent`` is the previous chunk's key (None for the first chunk of a chain)
    and ``ns`` the namespace digest; the nvme tier keeps both so the index can be
    rebuilt from disk. ``payload`` is the encoded chunk (header + body).
    """

    key: ChunkKey
    parent: ChunkKey | None
    ns: bytes
    payload: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class ShmGrant:
    """Where the leading chunks of a leased lookup lie in the store's shared memory.

    ``handles`` are (region, offset, length), in key order, valid while lease
    ``lease_id`` lasts: ``lease_ttl_s`` from when the store granted it, which was
    after ``sent`` (the caller's ``time.monotonic()`` before it asked; the clock is
    system-wide, so any process on the host can judge the lease by it). Plain
    values only: it travels from a scheduler to its workers.
    """

    lease_id: int
    lease_ttl_s: float
    sent: float
    handles: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The stored prefix of a key chain: its length, the tier of each chunk, a lease."""

    matched: int
    tiers: list[str]
    lease_id: int | None = None
    pending: int = 0  # missing chunks another producer is computing (wait for them)
    reserved: int = 0  # missing chunks now reserved to the caller (compute and put them)
    shm: ShmGrant | None = None  # asked for with the lease, by a caller on the store's host


@dataclass(frozen=True, slots=True)
class PutResult:
    """Chunks stored, already stored, and refused (key and a reason a person can read)."""

    stored: int
    duplicates: int
    rejected: list[tuple[ChunkKey, str]]
