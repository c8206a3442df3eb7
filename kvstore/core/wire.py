"""Hand-coded protobuf framing for the two bulk messages, ``Chunk`` and ``PutRequest``.

Offers ``encode_chunk``, ``parse_chunk``, ``encode_put_request``, ``encode_put_part``
and ``parse_put_message``. The bytes are exactly what protoc's code
would produce or accept for ``kvstore.v1.Chunk`` / ``PutRequest``, so stock gRPC tools
still understand them; doing it by hand avoids protobuf's copy and parse of every
megabyte payload (it halves streaming throughput). A large payload may be put in parts:
the chunk's ``total_length`` says its whole size, and the next messages carry the rest
(``PutRequest.part``). Pure: no grpc import.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.core.types import ChunkRecord, InvalidArgument

_KEY_TAG = b"\x0a"  # field 1, length-delimited
_PAYLOAD_TAG = b"\x12"  # field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidArgument("truncated or oversized varint in message")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) pairs: ints for varints, views for length-delimited."""
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            yield field, value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise InvalidArgument("length-delimited field runs past the end of the message")
            yield field, buf[pos : pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise InvalidArgument(f"unsupported protobuf wire type {wire_type}")
    if pos != len(buf):
        raise InvalidArgument("fixed-width field runs past the end of the message")


def chunk_prefix(key: bytes, payload_len: int) -> bytes:
    """The bytes of a ``Chunk`` message that come before its payload."""
    return _KEY_TAG + _varint(len(key)) + key + _PAYLOAD_TAG + _varint(payload_len)


def encode_chunk(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    return b"".join((chunk_prefix(key, memoryview(payload).nbytes), payload))


def parse_chunk(message: bytes) -> tuple[bytes, memoryview | None]:
    """(key, payload view or None) of a ``Chunk``."""
    key = b""
    payload = None
    for field, value in _fields(memoryview(message)):
        if field == 1 and isinstance(value, memoryview):
            key = bytes(value)
        elif field == 2 and isinstance(value, memoryview):
            payload = value
    return key, payload


def encode_put_request(records: Sequence[ChunkRecord], total_length: int = 0) -> bytes:
    """A ``PutRequest`` of ``records``; with ``total_length``, the last record's payload is
    only the first part of one that many bytes long (the rest follows in parts)."""
    parts: list[bytes | bytearray | memoryview] = []
    for i, rec in enumerate(records):
        body_parts = [_KEY_TAG + _varint(len(rec.key)) + rec.key]
        if rec.parent:
            body_parts.append(b"\x12" + _varint(len(rec.parent)) + rec.parent)
        if rec.ns:
            body_parts.append(b"\x1a" + _varint(len(rec.ns)) + rec.ns)
        size = memoryview(rec.payload).nbytes
        body_parts.append(b"\x22" + _varint(size))
        head = b"".join(body_parts)
        tail = b"\x28" + _varint(total_length) if total_length and i == len(records) - 1 else b""
        parts += [b"\x0a" + _varint(len(head) + size + len(tail)), head, rec.payload, tail]
    return b"".join(parts)


def encode_put_part(part: bytes | bytearray | memoryview) -> bytes:
    """A ``PutRequest`` that carries only the next part of a payload sent in parts."""
    return b"".join((b"\x12" + _varint(memoryview(part).nbytes), part))


@dataclass(frozen=True, slots=True)
class PutMessage:
    """One parsed ``PutRequest``: whole chunks, and what it carries of a chunk in parts.

    ``total_length`` is nonzero when the last of ``records`` holds only the first part of
    its payload; ``part`` is the next part of the payload of a chunk sent before.
    """

    records: list[ChunkRecord]
    total_length: int = 0
    part: memoryview | None = None


def parse_put_message(message: bytes) -> PutMessage:
    """The chunks and payload part of a ``PutRequest``; payloads are views of ``message``."""
    records = []
    total = part = None
    for field, value in _fields(memoryview(message)):
        if field == 2 and isinstance(value, memoryview):
            part = value
        if field != 1 or not isinstance(value, memoryview):
            continue
        if total:
            raise InvalidArgument("only the last chunk of a PutRequest may be sent in parts")
        key = parent = ns = b""
        payload: memoryview = memoryview(b"")
        for sub, sv in _fields(value):
            if sub == 5 and isinstance(sv, int):
                total = sv
            if not isinstance(sv, memoryview):
                continue
            if sub == 1:
                key = bytes(sv)
            elif sub == 2:
                parent = bytes(sv)
            elif sub == 3:
                ns = bytes(sv)
            elif sub == 4:
                payload = sv
        records.append(ChunkRecord(key, parent or None, ns, payload))
    if total and total <= payload.nbytes:
        raise InvalidArgument(
            f"chunk {key.hex()} is sent in parts of {total} bytes in all, "
            f"but its first part alone is {payload.nbytes} bytes"
        )
    return PutMessage(records, total or 0, part)
