"""Hand-coded Chunk/PutRequest framing is byte-compatible with protoc's code."""

import pytest

from kvstore.core import wire
from kvstore.core.types import ChunkRecord, InvalidArgument
from kvstore.rpc.pb import pb


@pytest.mark.parametrize("size", [1, 127, 128, 300, 1 << 20])
def test_chunk_matches_protobuf_both_ways(size):
    key, payload = b"k" * 16, bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    ours = wire.encode_chunk(key, payload)
    assert ours == pb.Chunk(key=key, payload=payload).SerializeToString()
    k, p = wire.parse_chunk(ours)
    assert k == key and bytes(p) == payload


def test_put_request_matches_protobuf_both_ways():
    records = [
        ChunkRecord(b"a" * 16, None, b"n" * 32, b"p" * 200),
        ChunkRecord(b"b" * 16, b"a" * 16, b"", b"q" * 70000),
    ]
    ours = wire.encode_put_request(records)
    theirs = pb.PutRequest(
        chunks=[
            pb.PutChunk(key=r.key, parent=r.parent or b"", namespace=r.ns, payload=r.payload)
            for r in records
        ]
    ).SerializeToString()
    assert ours == theirs
    back = wire.parse_put_request(theirs)
    assert [(r.key, r.parent, r.ns, bytes(r.payload)) for r in back] == [
        (r.key, r.parent, r.ns, r.payload) for r in records
    ]


@pytest.mark.parametrize(
    "bad", [b"\x0a\xff", b"\x0a\x05abc", b"\x0b", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"]
)
def test_malformed_messages_raise_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        wire.parse_put_request(bad)
