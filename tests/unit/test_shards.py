"""Rendezvous placement of key chains on shards: stable, balanced, and adding a shard
moves only the chains the new shard wins (about 1/N)."""

from __future__ import annotations

import os

import pytest

from kvstore.client.shards import rendezvous, shard_targets
from kvstore.core.types import InvalidArgument

ROOTS = [os.urandom(16) for _ in range(20_000)]
THREE = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def test_chains_spread_evenly_and_always_land_on_the_same_shard():
    counts = [0, 0, 0]
    for root in ROOTS:
        counts[rendezvous(root, THREE)] += 1
    assert all(abs(c - len(ROOTS) / 3) < 0.05 * len(ROOTS) for c in counts), counts
    assert [rendezvous(r, THREE) for r in ROOTS[:100]] == [
        rendezvous(r, THREE) for r in ROOTS[:100]
    ]
    # the order the shards are listed in does not matter
    moved = [THREE[::-1][rendezvous(r, THREE[::-1])] for r in ROOTS[:500]]
    assert moved == [THREE[rendezvous(r, THREE)] for r in ROOTS[:500]]


def test_adding_a_shard_moves_about_a_quarter_of_the_chains_all_to_the_new_one():
    four = THREE + ["10.0.0.4:50051"]
    moved = 0
    for root in ROOTS:
        before, after = THREE[rendezvous(root, THREE)], four[rendezvous(root, four)]
        if before != after:
            moved += 1
            assert after == four[3]  # nothing moves between the old shards
    assert 0.22 < moved / len(ROOTS) < 0.28


def test_shard_specs():
    assert shard_targets("a:1, b:2") == ["a:1", "b:2"]
    assert shard_targets(["a:1"]) == ["a:1"]
    assert "127.0.0.1:7" in shard_targets("dns:localhost:7")
    for bad in ("", "a:1,a:1", "dns:nohostport"):
        with pytest.raises(InvalidArgument):
            shard_targets(bad)
