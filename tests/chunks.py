"""Real chunk payloads for tests: valid headers, distinct contents, chained keys.

Offers ``payload(seed)``, ``chain(n, seed, ns)``, ``keys_of``, ``payloads_of``,
``CHUNK_COST``, the room one such chunk takes in a memory tier, and ``pick_per_shard``, test
chains picked so that every shard of a spec gets as many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from kvstore.client.shards import rendezvous, shard_targets
from kvstore.core import codec
from kvstore.core.keys import Namespace, chunk_keys
from kvstore.core.types import ChunkRecord
from kvstore.server.tiers.extents import ExtentTable

SHAPE = (2, 2, 32, 64)  # 32 KiB of fp16 K+V per chunk
NAMESPACE = Namespace("tiny-test", "r0", SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[2], "raw")


def payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE, generator=g).half()
    v = torch.randn(SHAPE, generator=g).half()
    return bytes(codec.encode(k, v, "raw"))


CHUNK_COST = ExtentTable.cost(len(payload(0)))


def chain(n: int, seed: int = 0, ns: Namespace = NAMESPACE) -> list[ChunkRecord]:
    """``n`` chained chunks of a prompt whose tokens are derived from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=g).tolist()
    digest = ns.digest()
    keys = chunk_keys(digest, tokens, ns.chunk_tokens)
    return [
        ChunkRecord(k, keys[i - 1] if i else None, digest, payload(seed * 1000 + i))
        for i, k in enumerate(keys)
    ]


def keys_of(records: list[ChunkRecord]) -> list[bytes]:
    return [r.key for r in records]


def payloads_of(records: list[ChunkRecord]) -> list[bytes]:
    return [bytes(r.payload) for r in records]


T = TypeVar("T")


def pick_per_shard(
    spec: str, n: int, candidates: Iterable[T], root: Callable[[T], bytes]
) -> list[T]:
    """``n`` of ``candidates`` for each shard of ``spec``, shard 0's first, each on the shard
    that rendezvous hashing of its chain's ``root`` key picks (as the client does).

    A fixed set of chains cannot be used: the shards' ports are random, and so is its split
    (eight chains over two shards all landed on one about once in 128 runs).
    """
    targets = shard_targets(spec)
    picked: list[list[T]] = [[] for _ in targets]
    for c in candidates:
        home = picked[rendezvous(root(c), targets)]
        if len(home) < n:
            home.append(c)
        if min(len(h) for h in picked) == n:
            return [x for home in picked for x in home]
    raise ValueError(f"the candidates ran out before every shard had {n}")
