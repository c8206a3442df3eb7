"""How the nvme tier frames a value: a fixed header, then the body. Pure, no I/O.

Offers ``frame_into(out, key, parent, ns, compression, raw_len, body)`` (copies the body),
``seal(out, key, parent, ns, compression, raw_len, body_len)`` (a body written in place),
``framed_size(body_len)``, ``parse_header(value)`` (cheap, for ``scan``),
``verify(key, value)`` (header and checksum), ``body_of(value)``, ``Header`` and
``COMPRESSION`` (name -> code). No pickle. Layout, little-endian::

    magic b"KVN1" | version u8 | compression u8 | flags u8 (bit 0: has parent)
    | ns 32 B | parent 16 B (zeros if none) | raw payload length u64 | checksum u64
    | body: the payload as stored (a zstd frame, or the raw bytes)

``checksum`` is xxh3-64 over the key, the header up to the checksum, and the body,
so a flipped bit anywhere in the value, or a value under the wrong key, fails
``verify``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.core.types import KEY_BYTES, ChunkKey

MAGIC = b"KVN1"
VERSION = 1
COMPRESSION = {"none": 0, "zstd": 1}
FLAG_HAS_PARENT = 1
HEADER = struct.Struct("<4sBBB32s16sQQ")
_CHECKSUM = struct.Struct("<Q")
_BIG = 1 << 20  # bodies from here on are copied by numpy, outside the GIL
_CHECKSUM_AT = HEADER.size - _CHECKSUM.size
_NO_PARENT = bytes(KEY_BYTES)


@dataclass(frozen=True, slots=True)
class Header:
    compression: int
    parent: ChunkKey | None
    ns: bytes
    raw_len: int


def framed_size(body_len: int) -> int:
    return HEADER.size + body_len


def body_of(value: memoryview) -> memoryview:
    return value[HEADER.size :]


def frame_into(
    out: memoryview,
    key: ChunkKey,
    parent: ChunkKey | None,
    ns: bytes,
    compression: int,
    raw_len: int,
    body: memoryview,
) -> memoryview:
    """Write header and body into ``out`` (at least ``framed_size`` bytes); the value view."""
    dest = out[HEADER.size : framed_size(len(body))]
    if len(body) >= _BIG and not dest.readonly:
        # numpy copies without the GIL: a 32 MiB slice assignment held it for milliseconds
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(body, np.uint8))
    else:
        dest[:] = body
    return seal(out, key, parent, ns, compression, raw_len, len(body))


def seal(
    out: memoryview,
    key: ChunkKey,
    parent: ChunkKey | None,
    ns: bytes,
    compression: int,
    raw_len: int,
    body_len: int,
) -> memoryview:
    """Write the header (checksum included) before a body already at ``out[HEADER.size:]``."""
    value = out[: framed_size(body_len)]
    flags = 0 if parent is None else FLAG_HAS_PARENT
    HEADER.pack_into(
        value, 0, MAGIC, VERSION, compression, flags, ns, parent or _NO_PARENT, raw_len, 0
    )
    _CHECKSUM.pack_into(value, _CHECKSUM_AT, _checksum(key, value))
    return value


def parse_header(value: memoryview) -> Header | None:
    """The header, or None when the value cannot be ours (magic, version, codes, length)."""
    if len(value) < HEADER.size:
        return None
    magic, version, comp, flags, ns, parent, raw_len, _ = HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION or comp not in COMPRESSION.values():
        return None
    if comp == COMPRESSION["none"] and len(value) - HEADER.size != raw_len:
        return None
    return Header(comp, parent if flags & FLAG_HAS_PARENT else None, ns, raw_len)


def verify(key: ChunkKey, value: memoryview) -> Header | None:
    """The header if the whole value is intact and belongs to ``key``, else None."""
    head = parse_header(value)
    if head is None:
        return None
    (stored,) = _CHECKSUM.unpack_from(value, _CHECKSUM_AT)
    return head if stored == _checksum(key, value) else None


def _checksum(key: ChunkKey, value: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value[:_CHECKSUM_AT])
    h.update(value[HEADER.size :])
    return h.intdigest()
