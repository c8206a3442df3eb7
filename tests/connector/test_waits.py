"""A request that waits for chunks another node is computing, against a real store server:
the P/D handoff (a prefill node's finished request names the chunks it saved, the decode
node waits for them) and single-flight (engines meeting the same new prefix at once: one
reserves and computes, the others wait). vLLM's own ``Request`` objects drive the halves;
real engines behind vllm-router are in ``tests/e2e/test_pd_router.py``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from connector.handoff import KEY, expected_chunks, handoff_params, is_handoff
from connector.scheduler import SchedulerHalf
from kvstore.server.grpc_server import StoreServer
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.connector.test_halves_with_store import BLOCK, CHUNK, NS, config, paged_cache
from tests.connector.test_traffic_plans import request, step, store_chunks

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

PROMPT = list(range(300, 300 + 4 * CHUNK + 5))  # 4 full chunks and a tail


@pytest.fixture
def store_address():
    server = StoreServer(TieredStore([DramTier(64 << 20)]), "127.0.0.1:0")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


def with_params(req_id: str, tokens: list[int], params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params})
    return Request(req_id, list(tokens), sp, None)


def half(address: str, **kw) -> SchedulerHalf:
    cfg = dataclasses.replace(config(address), **kw)
    return SchedulerHalf(cfg, NS, BLOCK)


def prefill(sched: SchedulerHalf, req) -> dict | None:
    """The prefill leg as vLLM drives it: lookup, one step computing the prompt, finish."""
    assert sched.matched_tokens(req, 0) == 0
    blocks = list(range(len(PROMPT) // BLOCK + 1))
    sched.build_meta(step(new=[(req, blocks, 0)], scheduled={req.request_id: len(PROMPT)}))
    return sched.finished(req)


# ---- P/D handoff ----------------------------------------------------------------------


def test_the_prefill_leg_names_the_prompt_chunks_it_saved_and_only_for_a_pd_proxy(store_address):
    producer = half(store_address)
    params = prefill(producer, with_params("p1", PROMPT, {"do_remote_decode": True}))
    assert params is not None and set(params) == {KEY}
    n, why = expected_chunks(params, NS.digest(), producer_keys(PROMPT))
    assert (n, why) == (4, "")
    assert producer.counters.handoffs == 1
    # a request no P/D proxy sent carries nothing back (single-flight off: p1's
    # reservation would make this engine wait for p1's saves, which no worker sends here)
    assert (
        prefill(half(store_address, single_flight=False), with_params("p2", PROMPT, None)) is None
    )


def producer_keys(tokens: list[int]) -> list[bytes]:
    from kvstore.core.keys import chunk_keys

    return chunk_keys(NS.digest(), tokens, CHUNK)


def test_the_decode_leg_waits_for_the_handed_off_chunks_then_loads_them(store_address):
    params = handoff_params(NS.digest(), producer_keys(PROMPT), 4)
    consumer = half(store_address, wait_timeout_s=30.0)
    req = with_params("d1", PROMPT, params)
    assert consumer.matched_tokens(req, 0) is None  # nothing stored yet: ask again
    assert consumer.matched_tokens(req, 0) is None
    store_chunks(store_address, PROMPT[: 2 * CHUNK], paged_cache(num_blocks=32, seed=2))
    time.sleep(0.02)
    assert consumer.matched_tokens(req, 0) is None  # 2 of 4: still waiting
    store_chunks(store_address, PROMPT, paged_cache(num_blocks=32, seed=2))
    time.sleep(0.02)
    lookups = consumer.counters.lookups
    assert consumer.matched_tokens(req, 0) == 4 * CHUNK
    # polls take no leases; the poll that ends the wait leases what it will load
    assert consumer.counters.lookups == lookups + 2
    assert consumer._reqs["d1"].lease_ids, "the chunks to load are not leased"
    assert consumer.counters.waits == 1 and consumer.counters.wait_timeouts == 0
    # a lookup of a waiting request is not a miss in the hit-rate counters
    assert consumer.counters.lookup_tokens == 4 * CHUNK


def test_a_handoff_that_never_lands_times_out_into_a_recompute(store_address):
    params = handoff_params(NS.digest(), producer_keys(PROMPT), 4)
    consumer = half(store_address, wait_timeout_s=0.2)
    req = with_params("d2", PROMPT, params)
    t0 = time.monotonic()
    answers = []
    while time.monotonic() - t0 < 5:
        answers.append(consumer.matched_tokens(req, 0))
        if answers[-1] is not None:
            break
    assert answers[-1] == 0 and None in answers
    assert 0.2 <= time.monotonic() - t0 < 4.5  # bounded (a loaded host stretches polls)
    assert consumer.counters.wait_timeouts == 1
    # a resumption after a preemption does not wait again
    assert consumer.matched_tokens(req, 0) == 0


def test_params_from_another_namespace_or_prompt_are_ignored(store_address):
    consumer = half(store_address)
    other_ns = handoff_params(b"\x01" * len(NS.digest()), producer_keys(PROMPT), 4)
    other_prompt = handoff_params(NS.digest(), producer_keys(list(range(9, 900))), 4)
    junk = {KEY: {"v": 99}, "do_remote_prefill": False}
    others = [other_ns, other_prompt, junk, {"remote_engine_id": None}, {KEY: "x"}, None]
    # a decode leg (readable or not) is a handoff; another connector's params are not
    assert [is_handoff(p) for p in others] == [True, True, True, False, False, False]
    for i, params in enumerate(others[:4]):
        assert consumer.matched_tokens(with_params(f"x{i}", PROMPT, params), 0) == 0
    assert consumer.counters.waits == 0


def test_a_dead_store_ends_the_wait_at_once():
    params = handoff_params(NS.digest(), producer_keys(PROMPT), 4)
    consumer = half("127.0.0.1:1", wait_timeout_s=30.0, lookup_timeout_s=0.2)
    t0 = time.monotonic()
    assert consumer.matched_tokens(with_params("d3", PROMPT, params), 0) == 0
    assert time.monotonic() - t0 < 5  # one failed lookup, no waiting
    assert consumer.counters.lookup_failures == 1 and consumer.counters.waits == 0


# ---- single-flight --------------------------------------------------------------------


def test_engines_meeting_a_new_prefix_at_once_compute_it_once(store_address):
    a, b, c = (half(store_address, wait_timeout_s=30.0) for _ in range(3))
    assert a.matched_tokens(request("a", PROMPT), 0) == 0  # a reserves and computes
    assert a.counters.reservations == 1
    rb, rc = request("b", PROMPT), request("c", PROMPT + [7, 8, 9])
    assert b.matched_tokens(rb, 0) is None  # pending: a computes it
    assert c.matched_tokens(rc, 0) is None
    store_chunks(store_address, PROMPT, paged_cache(num_blocks=32, seed=3))  # a's saves
    time.sleep(0.02)
    assert b.matched_tokens(rb, 0) == 4 * CHUNK
    assert c.matched_tokens(rc, 0) == 4 * CHUNK
    assert b.counters.reservations == 0 and b.counters.waits == 1


def test_a_producer_that_dies_leaves_the_others_computing_after_its_reservation_lapses(
    store_address,
):
    a = half(store_address, reserve_ttl_s=0.3)
    b = half(store_address, wait_timeout_s=30.0)  # connected first: it asks within the ttl
    rb = request("b", PROMPT)
    assert a.matched_tokens(request("a", PROMPT), 0) == 0  # a reserves, then dies
    t0 = time.monotonic()
    answers = []
    while time.monotonic() - t0 < 10:
        answers.append(b.matched_tokens(rb, 0))
        if answers[-1] is not None:
            break
    assert None in answers and answers[-1] == 0
    assert 0.3 <= time.monotonic() - t0 < 5
    assert b.counters.reservations == 1  # b now computes it
    assert b.counters.wait_timeouts == 0


def test_a_slow_producer_renews_its_reservation_while_it_computes(store_address):
    a = half(store_address, reserve_ttl_s=1.2)
    b = half(store_address, wait_timeout_s=30.0)
    ra, rb = request("a", PROMPT), request("b", PROMPT)
    assert a.matched_tokens(ra, 0) == 0 and a.counters.reservations == 1
    blocks = list(range(len(PROMPT) // BLOCK + 1))
    a.build_meta(step(new=[(ra, blocks, 0)], scheduled={"a": CHUNK}))
    # a prefills one chunk a step (chunked prefill), for longer than its claim's TTL
    for done in range(CHUNK, 4 * CHUNK, CHUNK):
        time.sleep(0.7)  # past half the TTL: renewed; 0.5 s to spare on a loaded host
        a.build_meta(step(cached=[(ra, None, done)], scheduled={"a": CHUNK}))
        assert b.matched_tokens(rb, 0) is None  # still a's: renewed, not lapsed
    assert b.counters.reservations == 0


def test_single_flight_off_never_waits(store_address):
    a = half(store_address)
    b = half(store_address, single_flight=False)
    assert a.matched_tokens(request("a", PROMPT), 0) == 0
    assert b.matched_tokens(request("b", PROMPT), 0) == 0
    assert b.counters.waits == 0
