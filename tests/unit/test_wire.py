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
    back = wire.parse_put_message(theirs)
    assert back.total_length == 0 and back.part is None
    assert [(r.key, r.parent, r.ns, bytes(r.payload)) for r in back.records] == [
        (r.key, r.parent, r.ns, r.payload) for r in records
    ]


@pytest.mark.parametrize(
    "bad", [b"\x0a\xff", b"\x0a\x05abc", b"\x0b", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"]
)
def test_malformed_messages_raise_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        wire.parse_put_message(bad)


def test_a_payload_in_parts_matches_protobuf_both_ways():
    records = [
        ChunkRecord(b"a" * 16, None, b"n" * 32, b"p" * 200),
        ChunkRecord(b"b" * 16, b"a" * 16, b"", b"q" * 300),  # the first 300 of 70000 bytes
    ]
    ours = wire.encode_put_request(records, total_length=70000)
    theirs = pb.PutRequest(
        chunks=[
            pb.PutChunk(key=r.key, parent=r.parent or b"", namespace=r.ns, payload=r.payload)
            for r in records
        ]
    )
    theirs.chunks[1].total_length = 70000
    assert ours == theirs.SerializeToString()
    head = wire.parse_put_message(ours)
    assert head.total_length == 70000 and head.part is None
    assert [bytes(r.payload) for r in head.records] == [b"p" * 200, b"q" * 300]

    part = wire.encode_put_part(b"r" * 1000)
    assert part == pb.PutRequest(part=b"r" * 1000).SerializeToString()
    more = wire.parse_put_message(part)
    assert more.records == [] and more.total_length == 0 and bytes(more.part) == b"r" * 1000
    lying = wire.encode_put_request(records, total_length=300)  # no more than its first part
    with pytest.raises(InvalidArgument, match="its first part alone is 300 bytes"):
        wire.parse_put_message(lying)


def test_only_the_last_chunk_of_a_message_may_come_in_parts():
    first = pb.PutChunk(key=b"a" * 16, namespace=b"n" * 32, payload=b"p", total_length=10)
    then = pb.PutChunk(key=b"b" * 16, parent=b"a" * 16, payload=b"q")
    with pytest.raises(InvalidArgument, match="only the last chunk"):
        wire.parse_put_message(pb.PutRequest(chunks=[first, then]).SerializeToString())
