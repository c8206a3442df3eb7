"""Both connector halves over two real store servers given as one ``store`` list: each
request's chain lives whole on one shard (also when it is saved over several steps, its
later chunks continuing a chain stored earlier), loads find it there, and a shard that is
down costs only its own chains. Real engines with sharded stores run in
``tests/e2e/test_compose.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from connector.layouts import CpuLayout
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from connector.scheduler import SchedulerHalf
from kvstore.core.keys import chunk_keys
from kvstore.server.grpc_server import StoreServer
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.chunks import pick_per_shard
from tests.connector.test_halves_with_store import (
    BLOCK,
    CHUNK,
    DIM,
    NS,
    config,
    paged_cache,
    worker,
)
from tests.connector.test_traffic_plans import request

BPC = CHUNK // BLOCK


@pytest.fixture
def shards():
    servers = [StoreServer(TieredStore([DramTier(32 << 20)]), "127.0.0.1:0") for _ in range(2)]
    addresses = [f"127.0.0.1:{s.start()}" for s in servers]
    yield servers, addresses
    for s in servers:
        s.stop()


def test_chains_saved_over_several_steps_live_whole_on_one_shard(shards):
    servers, addresses = shards
    spec = ",".join(addresses)
    src = paged_cache(num_blocks=64, seed=1)
    saver = worker(spec, src, transport="tcp")
    candidates = (list(range(1000 * i, 1000 * i + 4 * CHUNK)) for i in itertools.count(1))
    prompts = pick_per_shard(spec, 4, candidates, lambda p: chunk_keys(NS.digest(), p, CHUNK)[0])
    all_keys = [chunk_keys(NS.digest(), p, CHUNK) for p in prompts]
    for step in (0, 2):  # two chunks per step: the second step continues the chain
        saves = [
            SaveSpec(
                f"r{i}",
                keys[step : step + 2],
                keys[step - 1] if step else None,
                list(range(step * BPC, (step + 2) * BPC)),
                keys[0],
            )
            for i, keys in enumerate(all_keys)
        ]
        saver.save(KVStoreMetadata(saves=saves))
        assert saver.flush(10)
    assert saver.counters.saved_chunks == 8 * 4 and saver.counters.save_failures == 0
    assert [s.store.stats().chunks for s in servers] == [16, 16]
    for i, keys in enumerate(all_keys):  # each chain whole on the shard its root hashes to
        assert [s.store.lookup(keys).matched for s in servers] == ([4, 0] if i < 4 else [0, 4])

    sched = SchedulerHalf(config(spec), NS, BLOCK)
    for i, p in enumerate(prompts):
        assert sched.matched_tokens(request(f"q{i}", p + [5]), 0) == 4 * CHUNK

    dst = paged_cache(num_blocks=64, seed=2)
    loader = worker(spec, dst, transport="tcp")
    loader.load(KVStoreMetadata(loads=[LoadSpec("q", all_keys[3], list(range(8, 16)), 0)]))
    assert loader.load_errors() == set()
    layout = CpuLayout(BLOCK, DIM)
    for name in src:
        for x, y in zip(
            layout.gather(src[name], list(range(8))), layout.gather(dst[name], list(range(8, 16)))
        ):
            assert torch.equal(x, y)

    # one shard down: its chains miss, the other's still hit, nothing raises
    servers[0].stop()
    hits = [sched.matched_tokens(request(f"z{i}", p + [5]), 0) for i, p in enumerate(prompts)]
    assert hits == [0] * 4 + [4 * CHUNK] * 4
