"""The cross-node e2e scenario of ``test_vllm_e2e.py`` with Llama-3-8B's KV geometry.

A random-weight Llama with 32 layers x 8 KV heads x head_dim 128 on a thin body
(hidden 256) runs in bf16 with ``chunk_tokens: 256`` and ``raw``: every chunk is
32 MiB, the size a real model's chunks have, where the tiny model's are a few KiB.
Node A prefills a two-chunk prefix into a real ``kvstore serve``; fresh node B
loads it and must answer token for token as A does over the prefix held in vLLM's own
prefix cache (its logprobs within 1e-4), then reuse one of those chunks for a shorter
shared prefix in other block ids. A is the reference: a third engine of this size
would cost the suite another half minute of start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.client import ClientOptions, KVStoreClient
from kvstore.core.keys import Namespace, chunk_keys
from kvstore.core.payload import HEADER_BYTES, parse_header
from tests.procs import KVSTORE, Served, stop_all, store_config, store_hits, wait_for_chunks

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

from tests.connector.test_vllm_e2e import (  # noqa: E402
    Engine,
    close_engines,
    connector,
    tokens,
)

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
CHUNK = 256
PREFIX = 2 * CHUNK
CHUNK_BYTES = 2 * LAYERS * KV_HEADS * CHUNK * HEAD_DIM * 2  # K and V, bf16: 32 MiB

# engine_driver.py runs float32 unless told otherwise; raw 256-token chunks here would
# then be 64 MiB + header, over the store's 64 MiB limit. Real deployments serve
# Llama-3-8B in bf16.
LLM_KWARGS = {"dtype": "bfloat16"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.connector.tiny_llama import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("llama3-8b-geometry"),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
    )


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    """One store and two engines started at once, both with the connector (raw): A, with
    vLLM's own prefix cache (the reference for a prefix B loads), and B, without."""
    work = tmp_path_factory.mktemp("cluster")
    store = Served(
        [KVSTORE, "serve", "--config", str(store_config(work / "kv.yaml", work / "lmdb"))]
    )
    conn = connector(store.address, "raw", CHUNK)
    engines: list[Engine] = []
    try:  # whatever fails to start, what did start is stopped below
        engines.append(Engine(model, conn, {**LLM_KWARGS, "enable_prefix_caching": True}))
        engines.append(Engine(model, conn, LLM_KWARGS))
        for e in engines:
            info = e.ready()
            assert "ready" in info, info
        yield {"store": store, "a": engines[0], "b": engines[1]}
    finally:
        stop_all([lambda: close_engines(engines), store.stop])


def stored_chunk_sizes(address: str, model: Path, prefix: list[int]) -> list[tuple]:
    """(codec, dtype, shape, bytes) of the chunks stored for ``prefix``, under the
    namespace the connector derives for this engine (``connector/namespace.py``)."""
    ns = Namespace(
        str(model), "main", LAYERS, KV_HEADS, HEAD_DIM, CHUNK, "raw", salt="kv_dtype=bfloat16"
    )
    keys = chunk_keys(ns.digest(), prefix, CHUNK)
    with KVStoreClient(address, ClientOptions(timeout_s=60.0)) as client:
        out = []
        for p in client.get(keys):
            h = parse_header(p)
            out.append((h.codec, h.src_dtype, h.shape, len(p)))
        return out


def test_b_loads_32_mib_chunks_that_a_prefilled_and_matches_vllms_own_cache(model, cluster):
    store, a, b = cluster["store"], cluster["a"], cluster["b"]
    prefix = tokens(1, PREFIX)
    first = a.generate(prefix + tokens(2, 20))
    assert first["num_cached_tokens"] == 0  # nothing stored yet: A computed everything
    assert wait_for_chunks(store.address, 2) == 2

    prompt = prefix + tokens(3, 20)
    hits_before = store_hits(store.address)
    got = b.generate(prompt)
    hits_after = store_hits(store.address)
    # A holds the prefix in vLLM's own cache, as B holds it from the store: both then
    # compute only the tail, the same kernels over the same KV. (Recomputing the prefix
    # with the tail is another kernel path: in bf16 on some CPUs (an AVX2-only AMD host
    # here) its tokens differ from the cached prefix's, with or without kvstore.)
    want = a.generate(prompt)
    assert want["num_cached_tokens"] == PREFIX
    assert store_hits(store.address) == hits_after  # A's own cache: its connector loaded nothing
    # another cache salt: another entry in vLLM's cache and other keys in the store
    again = a.generate(prompt, cache_salt="recompute")
    assert again["num_cached_tokens"] == 0
    same = "equal to" if again["tokens"] == want["tokens"] else "different from"
    print(f"\nA, prefix recomputed with the tail: tokens {same} those over its cached prefix")
    log = "".join(line for line in b.log if "kvstore" in line or "ERROR" in line)
    assert got["num_cached_tokens"] == PREFIX, log  # both chunks came from the store
    # a chunk outside shared memory can count twice: GetShm reads it, the client's Get again
    assert hits_after - hits_before >= 2
    assert got["tokens"] == want["tokens"]
    deltas = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    print(f"\nlogprob delta max {max(deltas)}; B's tokens {got['tokens']}")
    assert max(deltas) < 1e-4

    # what B loaded: two chunks of a real model's size
    assert (
        stored_chunk_sizes(store.address, model, prefix)
        == [("raw", "bfloat16", (LAYERS, KV_HEADS, CHUNK, HEAD_DIM), HEADER_BYTES + CHUNK_BYTES)]
        * 2
    )

    # a shorter shared prefix reuses only its first chunk, in other block ids
    shorter = prefix[:CHUNK] + tokens(4, 30)
    got = b.generate(shorter)
    assert got["num_cached_tokens"] == CHUNK
    assert got["tokens"] == a.generate(shorter)["tokens"]
