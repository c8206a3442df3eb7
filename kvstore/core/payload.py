"""The versioned chunk payload header. Pure: no torch, so the server can validate.

Offers ``ChunkHeader`` (pack/parse), ``expected_body_len``, ``build_payload`` and
``parse_payload`` (validates magic, version, codec, dtype, shape, sizes and the
xxh3-64 checksum, raising ``PayloadError`` with a precise message).

Layout (little-endian), header then body::

    magic "KVSC" | version u16 | codec u8 | src_dtype u8 | layers u16 | kv_heads u16
    | tokens u32 | head_dim u16 | reserved u16 | body_len u64 | checksum u64

The checksum is xxh3-64 over the header bytes before it, then the body. The body
holds K then V in the canonical layout ``[layers, kv_heads, tokens, head_dim]``:
``raw`` in the source dtype; ``fp8`` as e4m3 codes for K and V, then float32
scales for K ``[L, H, D]`` (per channel) and V ``[L, H, T]`` (per token).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvstore.core.types import PayloadError

MAGIC = b"KVSC"
VERSION = 1
_HEADER = struct.Struct("<4sHBBHHIHHQQ")
HEADER_BYTES = _HEADER.size
# bytes hashed between two calls of parse_payload's ``pace``: ~50 us of xxh3 here. At
# 256 KiB the offers themselves (each lets the GIL go) made a 64 MiB check 2.6 ms, not 1.9
PACE_PIECE = 1 << 20

CODEC_IDS = {"raw": 0, "fp8": 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
# dtype name -> (wire id, bytes per element)
DTYPES = {"float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4)}
DTYPE_NAMES = {wire: name for name, (wire, _) in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    codec: str
    src_dtype: str
    layers: int
    kv_heads: int
    tokens: int
    head_dim: int
    body_len: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.kv_heads, self.tokens, self.head_dim)


def expected_body_len(codec: str, src_dtype: str, shape: tuple[int, int, int, int]) -> int:
    layers, heads, tokens, dim = shape
    elems = layers * heads * tokens * dim
    if codec == "raw":
        return 2 * elems * DTYPES[src_dtype][1]
    if codec == "fp8":
        return 2 * elems + 4 * (layers * heads * dim + layers * heads * tokens)
    raise PayloadError(f"unknown codec {codec!r}")


def _checksum(
    head: bytes | memoryview, body: bytes | memoryview, pace: Callable[[], None] | None = None
) -> int:
    h = xxhash.xxh3_64(head)
    if pace is None:
        h.update(body)
        return h.intdigest()
    view = memoryview(body).cast("B")
    for at in range(0, view.nbytes, PACE_PIECE):
        h.update(view[at : at + PACE_PIECE])
        pace()
    return h.intdigest()


def build_payload(header: ChunkHeader, body: bytes | bytearray | memoryview) -> bytearray:
    """Header + body in one buffer; ``header.body_len`` must equal ``len(body)``."""
    body = memoryview(body).cast("B")
    if header.body_len != body.nbytes:
        raise PayloadError(f"body is {body.nbytes} bytes, header says {header.body_len}")
    out = bytearray(HEADER_BYTES + body.nbytes)
    out[HEADER_BYTES:] = body
    seal_payload(header, out)
    return out


def seal_payload(header: ChunkHeader, out: bytearray | memoryview) -> None:
    """Write the header and checksum into ``out``, whose body (after ``HEADER_BYTES``) the
    caller already filled: encoders write the body in place instead of copying it in."""
    view = memoryview(out).cast("B")
    if header.body_len != view.nbytes - HEADER_BYTES:
        raise PayloadError(
            f"body is {view.nbytes - HEADER_BYTES} bytes, header says {header.body_len}"
        )
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        CODEC_IDS[header.codec],
        DTYPES[header.src_dtype][0],
        *header.shape[:3],
        header.head_dim,
        0,
        header.body_len,
        0,
    )[:-8]
    view[: len(head)] = head
    struct.pack_into("<Q", view, len(head), _checksum(head, view[HEADER_BYTES:]))


# headers already found valid, by (their bytes before the checksum, the payload's length):
# a load's chunks share one header, and each is parsed up to three times on its way
_VALID: dict[tuple[bytes, int], ChunkHeader] = {}
_VALID_MAX = 256


def parse_header(payload: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and check the header alone (no checksum): cheap admission control."""
    view = memoryview(payload).cast("B")
    seen = (bytes(view[: HEADER_BYTES - 8]), view.nbytes) if view.nbytes >= HEADER_BYTES else None
    header = _VALID.get(seen) if seen is not None else None
    if header is None:
        header = _parse_header(view)
        if len(_VALID) >= _VALID_MAX:
            _VALID.clear()
        _VALID[seen] = header  # only a header that passed every check gets here
    return header


def _parse_header(view: memoryview) -> ChunkHeader:
    if view.nbytes < HEADER_BYTES:
        raise PayloadError(
            f"payload is {view.nbytes} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    magic, version, codec_id, dtype_id, layers, heads, tokens, dim, _, body_len, _ = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(
            f"payload version {version} is not supported (this build reads {VERSION})"
        )
    if codec_id not in CODEC_NAMES:
        raise PayloadError(f"unknown codec id {codec_id}")
    if dtype_id not in DTYPE_NAMES:
        raise PayloadError(f"unknown source dtype id {dtype_id}")
    if min(layers, heads, tokens, dim) == 0:
        raise PayloadError(f"empty shape {(layers, heads, tokens, dim)}")
    header = ChunkHeader(
        CODEC_NAMES[codec_id], DTYPE_NAMES[dtype_id], layers, heads, tokens, dim, body_len
    )
    want = expected_body_len(header.codec, header.src_dtype, header.shape)
    if body_len != want:
        raise PayloadError(
            f"header body_len {body_len} does not match {header.codec} {header.shape} "
            f"{header.src_dtype} ({want} bytes)"
        )
    if view.nbytes != HEADER_BYTES + body_len:
        raise PayloadError(
            f"payload is {view.nbytes} bytes, header promises {HEADER_BYTES + body_len}"
        )
    return header


def parse_payload(
    payload: bytes | bytearray | memoryview, pace: Callable[[], None] | None = None
) -> tuple[ChunkHeader, memoryview]:
    """Validate header, sizes and checksum; return the header and a view of the body.

    With ``pace``, the body is hashed ``PACE_PIECE`` bytes at a time and ``pace()`` called
    after each piece (a server lets latency-bound threads run between them)."""
    header = parse_header(payload)
    view = memoryview(payload).cast("B")
    (stored,) = struct.unpack_from("<Q", view, HEADER_BYTES - 8)
    body = view[HEADER_BYTES:]
    if _checksum(view[: HEADER_BYTES - 8], body, pace) != stored:
        raise PayloadError("checksum mismatch: the payload was corrupted")
    return header, body
