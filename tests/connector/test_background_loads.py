"""Background loads (``load_async``) against a real store server: the scheduler plans the
load when vLLM allocates the blocks (the request is not scheduled until it is done), the
worker loads off the forward and reports the request done together with the blocks it
could not fill. vLLM's own ``Request`` and ``KVCacheBlocks`` drive the halves; a real
engine loading in the background is in ``test_vllm_e2e.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.layouts import CpuLayout
from connector.scheduler import SchedulerHalf
from kvstore.server.grpc_server import StoreServer
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.connector.test_halves_with_store import (
    BLOCK,
    CHUNK,
    DIM,
    NS,
    config,
    paged_cache,
    worker,
)
from tests.connector.test_traffic_plans import request, step, store_chunks

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

BPC = CHUNK // BLOCK
PROMPT = list(range(500, 500 + 3 * CHUNK + 7))


@pytest.fixture
def store_address():
    server = StoreServer(TieredStore([DramTier(64 << 20)]), "127.0.0.1:0")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def wait_done(w, want: set[str], timeout: float = 10.0) -> set[str]:
    done: set[str] = set()
    t0 = time.monotonic()
    while done != want and time.monotonic() - t0 < timeout:
        done |= w.loads_done()
        time.sleep(0.005)
    return done


def test_a_background_load_is_planned_at_allocation_and_lands_exactly(store_address):
    src = paged_cache(num_blocks=32, seed=1)
    store_chunks(store_address, PROMPT, src)
    sched = SchedulerHalf(config(store_address, load_async=True), NS, 32)
    req = request("r", PROMPT)
    assert sched.matched_tokens(req, 0) == 3 * CHUNK
    dst_ids = [20, 21, 9, 10, 11, 12]
    sched.after_alloc(req, 3 * CHUNK, blocks(dst_ids))
    meta = sched.build_meta(step())  # nothing scheduled: the load goes out anyway
    assert [(s.req_id, s.background, s.block_ids) for s in meta.loads] == [("r", True, dst_ids)]
    # when the request is scheduled after its load, nothing is loaded twice
    later = sched.build_meta(step(new=[(req, dst_ids + [13], 3 * CHUNK)], scheduled={"r": 7}))
    assert later.loads == []

    dst = paged_cache(num_blocks=32, seed=2)
    w = worker(store_address, dst)
    w.load(meta)  # returns at once; the loader thread fills the blocks
    assert wait_done(w, {"r"}) == {"r"}
    assert w.load_errors() == set()
    layout = CpuLayout(BLOCK, DIM)
    for name in src:
        assert all(
            torch.equal(x, y)
            for x, y in zip(
                layout.gather(src[name], list(range(3 * BPC))), layout.gather(dst[name], dst_ids)
            )
        )
    assert w.counters.loaded_tokens == 3 * CHUNK
    w.close()


def test_a_background_load_that_fails_reports_its_blocks_with_the_request(store_address):
    store_chunks(store_address, PROMPT[:CHUNK], paged_cache(num_blocks=32, seed=1))
    # over TCP: on the store's host the lookup's lease would keep a deleted chunk's bytes
    # readable until the load ends (tests/connector/test_lookup_grants.py)
    sched = SchedulerHalf(config(store_address, load_async=True, transport="tcp"), NS, 32)
    req = request("r", PROMPT)
    assert sched.matched_tokens(req, 0) == CHUNK
    sched.after_alloc(req, CHUNK, blocks([4, 5]))
    meta = sched.build_meta(step())
    # the store loses the chunk between lookup and load (evicted, restarted)
    from kvstore.client import KVStoreClient

    with KVStoreClient(store_address) as c:
        assert c.delete(meta.loads[0].keys) == 1
    w = worker(store_address, paged_cache(num_blocks=32, seed=2), transport="tcp")
    w.load(meta)
    assert wait_done(w, {"r"}) == {"r"}  # reported done: vLLM must not wait forever
    assert w.load_errors() == {4, 5}  # ...with the blocks to recompute, in the same pass
    assert w.counters.load_failures == 1
    w.close()


def test_without_load_async_loads_stay_in_the_step(store_address):
    store_chunks(store_address, PROMPT, paged_cache(num_blocks=32, seed=1))
    sched = SchedulerHalf(config(store_address), NS, 32)
    req = request("r", PROMPT)
    assert sched.matched_tokens(req, 0) == 3 * CHUNK
    sched.after_alloc(req, 3 * CHUNK, blocks([0, 1, 2, 3, 4, 5]))
    # planned in the step that schedules the request, as part of its forward
    meta = sched.build_meta(step(new=[(req, [0, 1, 2, 3, 4, 5, 6], 0)], scheduled={"r": 7}))
    assert [(s.req_id, s.background) for s in meta.loads] == [("r", False)]
