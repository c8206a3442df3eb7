"""The checks every chunk of a put passes before any tier sees it.

Offers ``validate_record(record, max_chunk_bytes)``: ``None`` for a chunk to admit, or
``(code, message)`` for one to refuse (``code`` is a fixed metrics label). Shared by the
store's own ``put`` and the put process, which checks payloads before it copies them.
"""

from __future__ import annotations

from kvstore.core.payload import parse_payload
from kvstore.core.types import ChunkRecord, InvalidArgument, check_key, check_ns
from kvstore.server.tiers.pacing import step_aside


def validate_record(
    rec: ChunkRecord, max_chunk_bytes: int | None, *, checksum: bool = True
) -> tuple[str, str] | None:
    """Keys and namespace well formed (``InvalidArgument`` if not: the whole request is
    bad), the size within bounds, the payload's header and checksum right (unless
    ``checksum`` is False: the put process checked them before it committed)."""
    check_key(rec.key)
    if rec.parent is not None:
        check_key(rec.parent, "parent")
    if rec.parent is None:
        check_ns(rec.ns)
    size = memoryview(rec.payload).nbytes
    if max_chunk_bytes is not None and size > max_chunk_bytes:
        return "too_large", f"chunk of {size} bytes exceeds max_chunk_bytes={max_chunk_bytes}"
    if not checksum:
        return None
    try:
        parse_payload(rec.payload, pace=step_aside)  # 32 MiB hashed in one go: ~3 ms
    except InvalidArgument as exc:
        return "bad_payload", f"bad payload: {exc}"
    return None
