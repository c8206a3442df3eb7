"""The key spec: published test vectors, and an independent re-derivation."""

import hashlib
import struct

import pytest
import xxhash

from kvstore.core.keys import Namespace, chunk_keys, part_key, request_root
from kvstore.core.types import InvalidArgument

LLAMA = Namespace(
    model="meta-llama/Llama-3.1-8B",
    revision="main",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    chunk_tokens=16,
    codec="fp8",
)
TINY = Namespace(
    model="tiny",
    revision="r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    chunk_tokens=32,
    codec="raw",
    salt="tenant-a",
)

# The vectors the README publishes: (namespace, token ids, chunk tokens) -> digest, keys.
VECTORS = [
    (
        LLAMA,
        list(range(40)),
        "76011e9fdbfe7a7c8f005081445e9befd8f3f7ccda09a3c4de0d719219e28ef7",
        ["dc65aa2e99d27d042af65733b474c741", "55f44e41cea6b6dc1599a701555a177e"],
    ),
    (
        TINY,
        [7] * 64 + [4294967295] * 32,
        "d12bfd528d10bdc9459c586445c20fcdc1bc37fd1fa0e4c05772627d53afdd63",
        [
            "788e06caa805aa220b9a025ff279f7c0",
            "07a503f861ca7e5c206bed07d5c185be",
            "9a04c05fe63109f982509855a950555e",
        ],
    ),
]


@pytest.mark.parametrize(("ns", "tokens", "digest", "keys"), VECTORS)
def test_published_vectors(ns, tokens, digest, keys):
    assert ns.digest().hex() == digest
    assert [k.hex() for k in chunk_keys(ns.digest(), tokens, ns.chunk_tokens)] == keys


# Requests with their own identity (LoRA adapter, cache salt) and chunks with extras
# (multimodal inputs): (namespace, identity, tokens, extras) -> root, keys.
REQUEST_VECTORS = [
    (
        LLAMA,
        {"lora": "sql-adapter", "cache_salt": "tenant-x"},
        list(range(40)),
        None,
        "96f61c1dab985aa2825acd022e34be3facedb2209920df57f2c4197400111335",
        ["5e061b125b317c852174fea510d41855", "b02d417aeaf1c38cf6cd22603df177e9"],
    ),
    (
        TINY,
        {"cache_salt": "tenant-x"},
        [7] * 64 + [4294967295] * 32,
        [None, b'[["img-0",5]]'],
        "1cdabc525bd0a840aa612f9290fe8b6fc68e8edc7f748835839bbd8c7ce625fc",
        [
            "3a2a7816bad54c681f420e770c57e8f3",
            "491106964c637965a110f84be42b1766",
            "fe0b1d3d58376f396a3fbefb679898da",
        ],
    ),
]


@pytest.mark.parametrize(("ns", "identity", "tokens", "extras", "root", "keys"), REQUEST_VECTORS)
def test_published_request_vectors(ns, identity, tokens, extras, root, keys):
    got_root = request_root(ns.digest(), identity)
    assert got_root.hex() == root
    got = chunk_keys(got_root, tokens, ns.chunk_tokens, extras=extras)
    assert [k.hex() for k in got] == keys


def test_request_roots_and_extras_match_an_independent_derivation():
    ns = TINY.digest()
    identity = b'{"cache_salt":"s","lora":"a"}'
    root = hashlib.sha256(b"kvstore/v1/request" + ns + identity).digest()
    assert request_root(ns, {"lora": "a", "cache_salt": "s"}) == root
    tokens = list(range(64))
    extra = b"image"
    k0 = xxhash.xxh3_128(b"kvstore/v1" + root + struct.pack("<32I", *tokens[:32])).digest()
    body = struct.pack("<32I", *tokens[32:]) + b"extra" + struct.pack("<I", 5) + extra
    k1 = xxhash.xxh3_128(k0 + body).digest()
    assert chunk_keys(root, tokens, 32, extras=[None, extra]) == [k0, k1]


def test_no_identity_keeps_the_namespace_chain_and_any_identity_leaves_it():
    ns = TINY.digest()
    assert request_root(ns, None) == ns
    assert request_root(ns, {"lora": "", "cache_salt": ""}) == ns
    roots = {
        request_root(ns, ident)
        for ident in (
            {"lora": "a"},
            {"lora": "b"},
            {"cache_salt": "a"},
            {"lora": "a", "cache_salt": "a"},
        )
    }
    assert len(roots) == 4 and ns not in roots
    tokens = list(range(64))
    plain = chunk_keys(ns, tokens, 32)
    assert chunk_keys(ns, tokens, 32, extras=[None, None]) == plain
    with_image = chunk_keys(ns, tokens, 32, extras=[None, b"x"])
    assert with_image[0] == plain[0] and with_image[1] != plain[1]


def test_canonical_json_is_sorted_and_compact():
    assert LLAMA.canonical_json() == (
        b'{"chunk_tokens":16,"codec":"fp8","head_dim":128,"model":"meta-llama/Llama-3.1-8B",'
        b'"num_kv_heads":8,"num_layers":32,"revision":"main","salt":null,"tp_size":1}'
    )


def test_keys_match_an_independent_derivation():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6] * 12
    ns = hashlib.sha256(TINY.canonical_json()).digest()
    prev = None
    expected = []
    for i in range(len(tokens) // 32):
        body = struct.pack("<32I", *tokens[i * 32 : (i + 1) * 32])
        seed = b"kvstore/v1" + ns if prev is None else prev
        prev = xxhash.xxh3_128(seed + body).digest()
        expected.append(prev)
    assert chunk_keys(ns, tokens, 32) == expected


def test_only_full_chunks_get_keys_and_chains_continue():
    ns = TINY.digest()
    tokens = list(range(100))
    keys = chunk_keys(ns, tokens, 32)
    assert len(keys) == 3
    assert chunk_keys(ns, tokens[:31], 32) == []
    assert chunk_keys(ns, tokens[32:96], 32, parent=keys[0]) == keys[1:]


def test_a_changed_token_changes_that_key_and_every_later_one():
    ns = TINY.digest()
    a = chunk_keys(ns, list(range(96)), 32)
    tokens = list(range(96))
    tokens[40] += 1
    b = chunk_keys(ns, tokens, 32)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_namespace_fields_separate_caches():
    salted = Namespace("tiny", "r1", 2, 2, 64, 32, "raw", salt="tenant-b")
    assert salted.digest() != TINY.digest()
    fp8 = Namespace("tiny", "r1", 2, 2, 64, 32, "fp8", salt="tenant-a")
    assert fp8.digest() != TINY.digest()


@pytest.mark.parametrize(
    "bad",
    [
        {"num_layers": 0},
        {"chunk_tokens": -32},
        {"codec": "int4"},
        {"model": ""},
        {"tp_size": True},
    ],
)
def test_bad_namespaces_are_refused(bad):
    fields = dict(
        model="m",
        revision="r",
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        chunk_tokens=32,
        codec="raw",
    )
    with pytest.raises(InvalidArgument):
        Namespace(**{**fields, **bad})


@pytest.mark.parametrize("tokens", [[-1] * 32, [2**32] * 32, [[1, 2]] * 32, [0.5] * 32])
def test_bad_token_ids_are_refused(tokens):
    with pytest.raises(InvalidArgument):
        chunk_keys(TINY.digest(), tokens, 32)


def test_part_keys_are_distinct_per_rank_and_identity_without_tp():
    key = chunk_keys(TINY.digest(), list(range(32)), 32)[0]
    assert part_key(key, 0, 1) == key
    parts = {part_key(key, r, 4) for r in range(4)}
    assert len(parts) == 4 and key not in parts
    with pytest.raises(InvalidArgument):
        part_key(key, 4, 4)
