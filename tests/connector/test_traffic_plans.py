"""The connector halves under what vLLM's real traffic does, against a real store server.

vLLM's own ``Request``, ``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData`` and
``LoRARequest`` objects drive the scheduler half; a real paged CPU cache tensor backs the
worker half. Scenarios: a request preempted and resumed in new blocks, requests that
differ only by LoRA adapter, cache salt or multimodal input, a save path that fails or
runs out of queue, chunks the store already holds, generated tokens. The same paths with
real engines are in ``test_vllm_traffic.py``.
"""

from __future__ import annotations

import pytest
import torch

from connector.layouts import CpuLayout
from connector.plan import KVStoreMetadata, SaveSpec
from connector.scheduler import SchedulerHalf
from kvstore.client import KVStoreClient
from kvstore.core.keys import chunk_keys
from kvstore.server.grpc_server import StoreServer
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.connector.test_halves_with_store import BLOCK, CHUNK, NS, config, paged_cache, worker

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import Request  # noqa: E402

BPC = CHUNK // BLOCK


@pytest.fixture
def store_address():
    server = StoreServer(TieredStore([DramTier(64 << 20)]), "127.0.0.1:0")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


def request(req_id: str, tokens: list[int], **kw) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=64), None, **kw)


def step(new=(), cached=(), resumed=(), scheduled=None, preempted=()) -> SchedulerOutput:
    """One step's ``SchedulerOutput``: ``new`` as (request, block ids, computed) and
    ``cached`` as (request, new block ids or None, computed)."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(r.request_id, r.prompt_token_ids, [], None, None, (blocks,), done, None)
        for r, blocks, done in new
    ]
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r.request_id for r, _, _ in cached],
        resumed_req_ids={r.request_id for r in resumed},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[(b,) if b is not None else None for _, b, _ in cached],
        num_computed_tokens=[done for _, _, done in cached],
        num_output_tokens=[0 for _ in cached],
    )
    out.num_scheduled_tokens = dict(scheduled or {})
    out.preempted_req_ids = set(preempted)
    return out


def store_chunks(address: str, tokens: list[int], caches, root: bytes | None = None) -> list:
    keys = chunk_keys(root or NS.digest(), tokens, CHUNK)
    w = worker(address, caches)
    w.save(KVStoreMetadata(saves=[SaveSpec("src", keys, None, list(range(len(keys) * BPC)))]))
    assert w.flush(10) and w.counters.saved_chunks == len(keys)
    w.close()
    return keys


def same_blocks(a, a_blocks, b, b_blocks) -> bool:
    layout = CpuLayout(BLOCK, a[next(iter(a))].shape[-1] // 2)
    return all(
        torch.equal(x, y)
        for name in a
        for x, y in zip(layout.gather(a[name], a_blocks), layout.gather(b[name], b_blocks))
    )


# ---- preemption ---------------------------------------------------------------------


def test_a_preempted_request_loads_its_chunks_again_into_its_new_blocks(store_address):
    src = paged_cache(num_blocks=32, seed=1)
    prompt = list(range(100, 100 + 3 * CHUNK + 10))
    store_chunks(store_address, prompt, src)
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    req = request("r", prompt)

    assert sched.matched_tokens(req, 0) == 3 * CHUNK
    sched.after_alloc(req, 3 * CHUNK)
    first = sched.build_meta(step(new=[(req, list(range(10, 17)), 3 * CHUNK)], scheduled={"r": 10}))
    assert [(ld.block_ids, ld.first_block) for ld in first.loads] == [(list(range(10, 16)), 0)]

    # vLLM preempts it: its blocks are freed, nothing is planned for it this step
    req.append_output_token_ids([7] * 5)
    assert sched.build_meta(step(preempted=["r"])).loads == []

    # and resumes it later in other blocks: it asks again, and the load must follow
    assert sched.matched_tokens(req, 0) == 3 * CHUNK
    sched.after_alloc(req, 3 * CHUNK)
    blocks = [20, 3, 21, 5, 22, 23, 24]
    meta = sched.build_meta(
        step(cached=[(req, blocks, 3 * CHUNK)], resumed=[req], scheduled={"r": 15})
    )
    assert [(ld.block_ids, ld.first_block) for ld in meta.loads] == [(blocks[:6], 0)]
    assert sched.counters.resumed_loads == 1

    dst = paged_cache(num_blocks=32, seed=2)
    loader = worker(store_address, dst)
    loader.load(meta)
    assert loader.load_errors() == set()
    assert same_blocks(src, list(range(6)), dst, blocks[:6])
    loader.close()
    sched.close()


def test_a_resumption_vllm_gives_no_external_tokens_loads_nothing(store_address):
    prompt = list(range(2 * CHUNK + 1))
    store_chunks(store_address, prompt, paged_cache())
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    req = request("r", prompt)
    sched.matched_tokens(req, 0)
    sched.after_alloc(req, 2 * CHUNK)
    first = sched.build_meta(step(new=[(req, [0, 1, 2, 3, 4], 2 * CHUNK)], scheduled={"r": 1}))
    loader = worker(store_address, paged_cache())
    loader.load(first)  # on the store's host the load took over its lease, and ends it
    loader.close()
    sched.build_meta(step(preempted=["r"]))
    assert sched.matched_tokens(req, 0) == 2 * CHUNK
    sched.after_alloc(req, 0)  # e.g. vLLM's own prefix cache covered it
    meta = sched.build_meta(
        step(cached=[(req, [5, 6, 7, 8, 9], 0)], resumed=[req], scheduled={"r": 2 * CHUNK + 1})
    )
    assert meta.loads == []
    assert sched.client.wait_releases(5)
    with KVStoreClient(store_address) as client:
        assert client.stats().active_leases == 0  # its lease went back with the load
    sched.close()


def test_vllm_taking_fewer_external_tokens_than_offered_loads_only_those_blocks(store_address):
    src = paged_cache(seed=5)
    prompt = list(range(40, 40 + 2 * CHUNK + 1))
    store_chunks(store_address, prompt, src)
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    req = request("r", prompt)
    assert sched.matched_tokens(req, 0) == 2 * CHUNK
    sched.after_alloc(req, 3 * BLOCK)  # vLLM trimmed the hit to three blocks
    meta = sched.build_meta(step(new=[(req, [9, 8, 7, 6, 5], 3 * BLOCK)], scheduled={"r": 33}))
    assert [(ld.block_ids, ld.first_block) for ld in meta.loads] == [([9, 8, 7], 0)]
    dst = paged_cache(seed=6)
    untouched = {n: t[6].clone() for n, t in dst.items()}
    loader = worker(store_address, dst)
    loader.load(meta)
    assert loader.load_errors() == set()
    assert same_blocks(src, [0, 1, 2], dst, [9, 8, 7])
    assert all(torch.equal(dst[n][6], untouched[n]) for n in dst)
    loader.close()
    sched.close()


def test_a_request_that_cannot_be_keyed_is_computed_and_never_raises(store_address):
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    req = request("bad", [2**33] * (2 * CHUNK + 1))  # not a uint32 token id
    assert sched.matched_tokens(req, 0) == 0
    meta = sched.build_meta(step(new=[(req, list(range(5)), 0)], scheduled={"bad": 2 * CHUNK}))
    assert meta.loads == [] and meta.saves == []
    sched.close()


# ---- per-request isolation ------------------------------------------------------------


def test_lora_adapters_and_cache_salts_key_requests_apart(store_address):
    prompt = list(range(500, 500 + 2 * CHUNK + 1))
    sched = SchedulerHalf(config(store_address), NS, BLOCK)

    def keys(**kw) -> list[bytes]:
        req = request(f"k{len(kw)}{sorted(kw.items())!r}", prompt, **kw)
        sched.matched_tokens(req, 0)
        got = list(sched._reqs[req.request_id].chain.keys)
        sched.finished(req)
        return got

    plain = keys()
    assert plain == chunk_keys(NS.digest(), prompt, CHUNK)  # no identity: the plain chain
    variants = {
        "salt x": keys(cache_salt="tenant-x"),
        "salt y": keys(cache_salt="tenant-y"),
        "lora a": keys(lora_request=LoRARequest("adapter-a", 1, "/a")),
        "lora b": keys(lora_request=LoRARequest("adapter-b", 2, "/b")),
        "lora a + salt x": keys(
            lora_request=LoRARequest("adapter-a", 1, "/a"), cache_salt="tenant-x"
        ),
    }
    every_key = [k for ks in variants.values() for k in ks] + plain
    assert len(set(every_key)) == len(every_key)  # no chunk shared between any two
    # an adapter is known by name: another node loads it under its own id and path
    assert keys(lora_request=LoRARequest("adapter-a", 7, "/elsewhere/a")) == variants["lora a"]
    sched.close()


def test_a_salted_request_never_hits_chunks_saved_without_its_salt(store_address):
    prompt = list(range(900, 900 + 2 * CHUNK + 1))
    src = paged_cache(seed=3)
    store_chunks(store_address, prompt, src)  # saved by a request without a salt
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    assert sched.matched_tokens(request("plain", prompt), 0) == 2 * CHUNK
    assert sched.matched_tokens(request("x", prompt, cache_salt="tenant-x"), 0) == 0
    store_chunks(store_address, prompt, src, root=sched._reqs["x"].chain.root)  # x's own
    assert sched.matched_tokens(request("x2", prompt, cache_salt="tenant-x"), 0) == 2 * CHUNK
    assert sched.matched_tokens(request("y", prompt, cache_salt="tenant-y"), 0) == 0
    sched.close()


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def test_multimodal_inputs_behind_identical_placeholders_key_apart(store_address):
    placeholder = 32000
    prompt = list(range(CHUNK)) + [placeholder] * 80 + list(range(3 * CHUNK - 80 + 1))
    sched = SchedulerHalf(config(store_address), NS, BLOCK)

    def keys(*features) -> list[bytes]:
        req = request(f"mm{len(sched._reqs)}", prompt, mm_features=list(features))
        sched.matched_tokens(req, 0)
        return list(sched._reqs[req.request_id].chain.keys)

    cat, dog = keys(image("cat", CHUNK, 80)), keys(image("dog", CHUNK, 80))
    shifted = keys(image("cat", CHUNK + 16, 64))
    text = keys()
    assert len(cat) == 4
    assert cat[0] == dog[0] == text[0]  # the chunk before the image is shared
    assert cat[1] != dog[1] and cat[2] != dog[2] and cat[3] != dog[3]
    assert cat[1] != shifted[1] and cat[1] != text[1]
    assert keys(image("cat", CHUNK, 80)) == cat
    sched.close()


def test_a_request_with_prompt_embeddings_is_neither_loaded_nor_saved(store_address):
    prompt = list(range(2 * CHUNK + 1))
    store_chunks(store_address, prompt, paged_cache())
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    req = request("e", prompt)
    req.prompt_embeds = torch.zeros(len(prompt), 8)
    assert sched.matched_tokens(req, 0) == 0
    meta = sched.build_meta(step(new=[(req, list(range(5)), 0)], scheduled={"e": len(prompt)}))
    assert meta.saves == [] and sched.counters.unkeyable == 1
    sched.close()


# ---- saving ---------------------------------------------------------------------------


def test_chunks_the_store_holds_are_not_sent_again(store_address):
    prompt = list(range(300, 300 + 4 * CHUNK))
    keys = store_chunks(store_address, prompt[: 2 * CHUNK], paged_cache())
    for load in (True, False):  # kv_both and kv_producer alike
        sched = SchedulerHalf(config(store_address), NS, BLOCK, load=load)
        req = request(f"r{load}", prompt)
        sched.matched_tokens(req, 0)
        meta = sched.build_meta(
            step(new=[(req, list(range(8)), 0)], scheduled={req.request_id: 4 * CHUNK})
        )
        all_keys = chunk_keys(NS.digest(), prompt, CHUNK)
        assert all_keys[:2] == keys
        assert [(s.keys, s.parent, s.block_ids) for s in meta.saves] == [
            (all_keys[2:], all_keys[1], [4, 5, 6, 7])
        ]
        sched.close()


@pytest.mark.parametrize("save_generated", [True, False])
def test_full_chunks_of_generated_tokens_are_saved(store_address, save_generated):
    prompt = list(range(CHUNK + 40))
    sched = SchedulerHalf(config(store_address, save_generated=save_generated), NS, BLOCK)
    req = request("g", prompt)
    sched.matched_tokens(req, 0)
    meta = sched.build_meta(step(new=[(req, [0, 1, 2, 3], 0)], scheduled={"g": len(prompt)}))
    assert [len(s.keys) for s in meta.saves] == [1]
    # decode, one token a step: the step that feeds token 127 completes chunk 1, but
    # only once vLLM knows that token (with async scheduling it may not be sampled yet)
    req.append_output_token_ids(list(range(2 * CHUNK - 1 - len(prompt))))
    meta = sched.build_meta(step(cached=[(req, None, 2 * CHUNK - 1)], scheduled={"g": 1}))
    assert meta.saves == []
    req.append_output_token_ids([5])
    meta = sched.build_meta(step(cached=[(req, None, 2 * CHUNK - 1)], scheduled={"g": 1}))
    keys = chunk_keys(NS.digest(), list(req.all_token_ids), CHUNK)
    saves = [(s.keys, s.parent, s.block_ids) for s in meta.saves]
    assert saves == ([([keys[1]], keys[0], [2, 3])] if save_generated else [])
    sched.close()


class _FailingLayout(CpuLayout):
    """A layout whose copy out of the cache fails for one block (a fault, not vLLM)."""

    def __init__(self, bad_block: int) -> None:
        super().__init__(BLOCK, 32)
        self.bad_block = bad_block

    def gather(self, kv_layer, block_ids, out=None):
        if self.bad_block in list(block_ids):
            raise RuntimeError("injected copy failure")
        return super().gather(kv_layer, block_ids, out)


def test_a_failing_save_never_raises_and_ends_only_its_own_chain(store_address):
    from connector.worker import WorkerHalf

    w = WorkerHalf(config(store_address), NS, BLOCK, 0, lambda kv, n: _FailingLayout(3))
    w.register(paged_cache())
    ka = chunk_keys(NS.digest(), list(range(4 * CHUNK)), CHUNK)
    kb = chunk_keys(NS.digest(), list(range(1, 1 + 2 * CHUNK)), CHUNK)
    w.save(  # a's second chunk (blocks 2, 3) cannot be copied; b is fine
        KVStoreMetadata(
            saves=[SaveSpec("a", ka[:2], None, [0, 1, 2, 3]), SaveSpec("b", kb, None, [4, 5, 6, 7])]
        )
    )
    w.save(KVStoreMetadata(saves=[SaveSpec("a", ka[2:], ka[1], [8, 9, 10, 11])]))
    assert w.flush(10)
    assert w.counters.save_failures == 1 and w.counters.save_skipped == 2
    assert w.counters.chains_ended == 1
    with KVStoreClient(store_address) as client:
        assert client.lookup(ka).matched == 1
        assert client.lookup(kb).matched == 2
        assert client.stats().chunks == 3  # nothing orphaned was sent
    w.finished({"a"})
    w.save(KVStoreMetadata(saves=[SaveSpec("a", ka[:1], None, [0, 1])]))  # a new request "a"
    assert w.flush(10) and w.counters.saved_chunks == 4
    w.close()


def test_a_refused_chunk_ends_its_chain_and_its_queued_successors_are_not_sent(store_address):
    keys = chunk_keys(NS.digest(), list(range(4 * CHUNK)), CHUNK)
    w = worker(store_address, paged_cache())
    # the parent keys[0] was never stored: the store refuses keys[1] as an orphan
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys[1:2], keys[0], [2, 3])]))
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys[2:], keys[1], [4, 5, 6, 7])]))
    assert w.flush(10)
    assert w.counters.save_failures == 1  # refused by the store
    assert w.counters.save_skipped == 2  # never sent
    with KVStoreClient(store_address) as client:
        assert client.stats().chunks == 0
    w.close()


def test_the_default_queue_takes_a_2000_token_prompt_whole(store_address):
    tokens = list(range(2000))
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    w = worker(store_address, paged_cache(num_blocks=64))
    w.save(KVStoreMetadata(saves=[SaveSpec("long", keys, None, list(range(len(keys) * BPC)))]))
    assert w.flush(30)
    assert w.counters.saved_chunks == len(keys) == 2000 // CHUNK
    assert w.counters.save_skipped == 0
    w.close()


def test_a_full_queue_keeps_the_prefix_that_fits_and_sends_no_orphans(store_address):
    keys = chunk_keys(NS.digest(), list(range(8 * CHUNK)), CHUNK)
    chunk_bytes = 2 * LAYERS_BYTES
    w = worker(store_address, paged_cache(), save_queue_bytes=3 * chunk_bytes)
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys[:6], None, list(range(12)))]))
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys[6:], keys[5], [12, 13, 14, 15])]))
    assert w.flush(10)
    assert w.counters.saved_chunks == 3
    assert w.counters.save_skipped == 5 and w.counters.chains_ended == 1
    with KVStoreClient(store_address) as client:
        assert client.lookup(keys).matched == 3
        assert client.stats().chunks == 3
    w.close()


# one chunk's K (or V) across layers in float32: layers x heads x tokens x dims x 4 bytes
LAYERS_BYTES = NS.num_layers * NS.num_kv_heads * CHUNK * NS.head_dim * 4
