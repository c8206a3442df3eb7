"""On the store's host the scheduler's leased lookup also says where the hit lies in the
store's shared memory; the load hands that lease and those places to the worker, which
reads them with no GetShm of its own and ends the lease itself. Real store server on
loopback, real shared memory, the connector's real halves."""

from __future__ import annotations

import pickle

import pytest

from connector.scheduler import SchedulerHalf
from tests.connector.test_halves_with_store import BLOCK, CHUNK, NS, config, paged_cache, worker
from tests.connector.test_traffic_plans import (
    request,
    same_blocks,
    step,
    store_address,  # noqa: F401  (fixture)
    store_chunks,
)

pytest.importorskip("vllm")

BPC = CHUNK // BLOCK
PROMPT = list(range(700, 700 + 3 * CHUNK + 5))
DST = list(range(10, 16))


def planned_load(address: str, prompt: list[int], transport: str = "shm"):
    """The scheduler's lookup and the step that schedules the request: its metadata."""
    sched = SchedulerHalf(config(address, transport=transport), NS, BLOCK)
    req = request("r", prompt)
    assert sched.matched_tokens(req, 0) == 3 * CHUNK
    sched.after_alloc(req, 3 * CHUNK)
    meta = sched.build_meta(step(new=[(req, DST + [16], 3 * CHUNK)], scheduled={"r": 5}))
    return sched, req, pickle.loads(pickle.dumps(meta))  # as vLLM hands it to a worker


def test_the_load_reads_under_the_lookups_lease_with_no_getshm(store_address):  # noqa: F811
    src = paged_cache(num_blocks=32, seed=1)
    store_chunks(store_address, PROMPT, src)
    sched, req, meta = planned_load(store_address, PROMPT)
    (spec,) = meta.loads
    assert len(spec.shm) == 1 and len(spec.shm[0].handles) == 3
    assert sched._reqs["r"].lease_ids == []  # handed to the worker with the places

    dst = paged_cache(num_blocks=32, seed=2)
    w = worker(store_address, dst, transport="shm")

    def no_getshm(*args, **kwargs):
        raise AssertionError("the worker asked GetShm for places it was given")

    w.client._get_shm_leased = no_getshm
    w.load(meta)
    assert w.load_errors() == set()
    assert same_blocks(src, list(range(3 * BPC)), dst, DST)
    assert w.client.shm_stats.grants_used == 1 and w.counters.loaded_chunks == 3
    assert w.counters.granted_loads == 1
    assert w.client.stats().active_leases == 0  # the worker ended the lookup's lease
    sched.finished(req)
    w.close()
    sched.close()


def test_a_chunk_deleted_after_the_lookup_still_loads_under_its_lease(store_address):  # noqa: F811
    """The lease keeps a deleted chunk's bytes until the load is done with them (the
    store frees them then), so what vLLM was promised is what it gets."""
    from kvstore.client import KVStoreClient

    src = paged_cache(num_blocks=32, seed=3)
    store_chunks(store_address, PROMPT, src)
    sched, req, meta = planned_load(store_address, PROMPT)
    with KVStoreClient(store_address) as c:
        assert c.delete(meta.loads[0].keys) == 3
    dst = paged_cache(num_blocks=32, seed=4)
    w = worker(store_address, dst, transport="shm")
    w.load(meta)
    assert w.load_errors() == set()
    assert same_blocks(src, list(range(3 * BPC)), dst, DST)
    # the worker's own client: its Release may still be on its way from a background
    # thread, and its stats() waits for that (another client's answer would race it)
    stats = w.client.stats()
    assert (stats.active_leases, stats.chunks) == (0, 0)  # lease ended, bytes freed
    w.close()
    sched.close()


def test_over_tcp_no_places_are_asked_for(store_address):  # noqa: F811
    store_chunks(store_address, PROMPT, paged_cache(num_blocks=32, seed=5))
    sched, req, meta = planned_load(store_address, PROMPT, transport="tcp")
    assert meta.loads[0].shm == (None,)
    assert len(sched._reqs["r"].lease_ids) == 1  # the scheduler's to end
    sched.finished(req)
    sched.close()
