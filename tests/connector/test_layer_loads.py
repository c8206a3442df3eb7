"""Layer-wise loads (``load_layerwise``): a loader thread writes a step's loads into the
paged cache a layer at a time while the forward runs, and each attention layer waits
only for its own. ``LayerLoads`` alone (threads, no store), then the worker against a
real store server with several requests loading in one step; a real engine loading
layer by layer is in ``test_vllm_e2e.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from connector.layer_loads import LayerLoads
from connector.layouts import CpuLayout
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.client import KVStoreClient
from kvstore.core import codec
from kvstore.core.keys import chunk_keys, part_key
from tests.connector.test_halves_with_store import (
    BLOCK,
    CHUNK,
    DIM,
    NS,
    paged_cache,
    store_address,  # noqa: F401  (fixture)
    worker,
)

LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def test_a_wait_returns_once_its_layer_is_written_not_before():
    job = LayerLoads(3, [7, 8])
    held = threading.Event()  # layer 1's copy is slow
    seen: list[int] = []

    def write(layer: int) -> None:
        if layer == 1:
            held.wait(5)
        seen.append(layer)

    loader = threading.Thread(target=lambda: (job.write(write), job.finish()))
    loader.start()
    assert job.wait(1, timeout_s=5)  # layer 0 is in: its attention need not wait for 1
    assert job.written == 1 and seen == [0]
    threading.Timer(0.2, held.set).start()
    assert not job.wait(2, timeout_s=0.05)  # ran out: cancelled once layer 1 was done
    assert job.cancelled and job.errors == {7, 8}  # nobody can say what the blocks hold
    loader.join(5)
    assert seen == [0, 1]  # the layer being written finished; none after the cancel
    assert job.result(1) == {7, 8}


def test_waits_follow_the_layers_and_the_result_waits_for_the_loader():
    job = LayerLoads(3, [1, 2, 3])
    release = threading.Event()

    def run() -> None:
        job.write(lambda layer: None)
        release.wait(5)  # settling the loads after the last layer
        job.fail([3])
        job.finish()

    loader = threading.Thread(target=run)
    loader.start()
    assert all(job.wait(n, timeout_s=5) for n in (1, 2, 3))
    assert job.written == 3 and not job.done
    got: list[set[int]] = []
    waiter = threading.Thread(target=lambda: got.append(job.result(5)))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()  # not before the loader said which blocks it could not fill
    release.set()
    waiter.join(5)
    assert got == [{3}]


def test_a_loader_that_stops_early_does_not_leave_the_forward_waiting():
    job = LayerLoads(4, [5])
    job.fail([5])
    job.finish()  # it wrote nothing: every wait returns at once, the blocks are errors
    assert job.wait(4, timeout_s=5) and job.result(5) == {5}


def save_prefixes(address: str, src, n: int) -> list[list[bytes]]:
    """``n`` two-chunk prefixes saved from blocks 2j, 2j+1, 2j+2, 2j+3 of ``src``..."""
    saver = worker(address, src)
    keys = [
        chunk_keys(NS.digest(), list(range(100 * j, 100 * j + 2 * CHUNK)), CHUNK) for j in range(n)
    ]
    saver.save(
        KVStoreMetadata(
            saves=[
                SaveSpec(f"s{j}", keys[j], None, list(range(4 * j, 4 * j + 4))) for j in range(n)
            ]
        )
    )
    assert saver.flush(10) and saver.counters.saved_chunks == 2 * n
    saver.close()
    return keys


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_several_requests_load_in_one_step_layer_by_layer_exactly(store_address, transport):  # noqa: F811
    src = paged_cache(num_blocks=32, seed=11)
    keys = save_prefixes(store_address, src, 3)
    with KVStoreClient(store_address) as c:  # the third prefix lost its second chunk
        assert c.delete([keys[2][1]]) == 1
    dst = paged_cache(num_blocks=32, seed=12)
    before = {n: t.clone() for n, t in dst.items()}
    w = worker(store_address, dst, transport=transport, load_layerwise=True)
    targets = [[20, 21, 22, 23], [13, 12, 11, 10], [24, 25, 26, 27]]
    w.load(KVStoreMetadata(loads=[LoadSpec(f"r{j}", keys[j], targets[j], 0) for j in range(3)]))
    layout = CpuLayout(BLOCK, DIM)

    def equal(name: str, src_blocks, dst_blocks) -> bool:
        got, want = layout.gather(dst[name], dst_blocks), layout.gather(src[name], src_blocks)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    w.wait_for_layer(LAYER_NAMES[0])  # what the first attention layer sees
    assert equal(LAYER_NAMES[0], range(0, 8), targets[0] + targets[1])
    w.wait_for_layer(LAYER_NAMES[1])
    assert w.load_errors() == {26, 27}  # the lost chunk's blocks: recomputed
    for name in LAYER_NAMES:
        assert equal(name, range(0, 8), targets[0] + targets[1])
        assert equal(name, [8, 9], [24, 25])  # the third's first chunk did load
        assert torch.equal(dst[name][26], before[name][26])
    assert (w.counters.layerwise_loads, w.counters.loaded_chunks) == (1, 5)
    assert w.counters.load_failures == 1
    assert w.client.shm_stats.chunks == (5 if transport == "shm" else 0)
    w.close()


def test_loads_of_the_next_step_wait_for_none_of_this_one(store_address):  # noqa: F811
    src = paged_cache(num_blocks=32, seed=13)
    keys = save_prefixes(store_address, src, 2)
    dst = paged_cache(num_blocks=32, seed=14)
    w = worker(store_address, dst, load_layerwise=True)
    for j, blocks in enumerate([[0, 1, 2, 3], [8, 9, 10, 11]]):  # one step each
        w.load(KVStoreMetadata(loads=[LoadSpec(f"r{j}", keys[j], blocks, 0)]))
        assert w.load_errors() == set()  # the step's end: all layers in
        for name in LAYER_NAMES:
            got = layout_gather(dst[name], blocks)
            want = layout_gather(src[name], list(range(4 * j, 4 * j + 4)))
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert w.counters.layerwise_loads == 2
    w.close()


def test_without_load_layerwise_the_load_is_whole_before_the_forward(store_address):  # noqa: F811
    src = paged_cache(num_blocks=32, seed=15)
    keys = save_prefixes(store_address, src, 1)
    dst = paged_cache(num_blocks=32, seed=16)
    w = worker(store_address, dst, load_layerwise=False)
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys[0], [4, 5, 6, 7], 0)]))
    for name in LAYER_NAMES:  # written when load() returned, no wait asked for
        got, want = layout_gather(dst[name], [4, 5, 6, 7]), layout_gather(src[name], [0, 1, 2, 3])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert w.counters.layerwise_loads == 0 and w.load_errors() == set()
    w.close()


def layout_gather(cache, blocks):
    return CpuLayout(BLOCK, DIM).gather(cache, blocks)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_load_that_starts_inside_a_chunk_writes_exactly_its_blocks(store_address, transport):  # noqa: F811
    """Same-host ``raw`` chunks are written from views of the staging buffer, all whole
    chunks of a layer in one copy; the first chunk here is cut (its first block is vLLM's
    own), so it goes apart. Over TCP, chunk by chunk. Both land exactly."""
    src = paged_cache(num_blocks=32, seed=17)
    saver = worker(store_address, src)
    keys = chunk_keys(NS.digest(), list(range(9000, 9000 + 4 * CHUNK)), CHUNK)
    saver.save(KVStoreMetadata(saves=[SaveSpec("s", keys, None, list(range(8)))]))
    assert saver.flush(10)
    saver.close()
    dst = paged_cache(num_blocks=32, seed=18)
    before = {n: t.clone() for n, t in dst.items()}
    w = worker(store_address, dst, transport=transport)
    fetched = w._fetch_decoded(LoadSpec("r", keys, list(range(8)), 0), "probe")
    assert (fetched.stacked is not None) == (transport == "shm")
    target = [30, 9, 20, 21, 22, 14, 15, 16]
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, target, 3)]))
    assert w.load_errors() == set()
    for name in LAYER_NAMES:
        got, want = layout_gather(dst[name], target[3:]), layout_gather(src[name], range(3, 8))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        for b in target[:3]:
            assert torch.equal(dst[name][b], before[name][b])
    w.close()


def loaded_the_slow_way(address: str, keys, target: list[int], seed: int) -> dict:
    """The cache ``paged_cache(seed)`` with the stored chunks of ``keys`` written into
    ``target`` (two blocks a chunk) one chunk at a time: fetched, decoded, scattered."""
    want = paged_cache(num_blocks=32, seed=seed)
    layout = CpuLayout(BLOCK, DIM)
    with KVStoreClient(address) as c:
        payloads = c.get([part_key(k, 0, 1) for k in keys])
    for j, payload in enumerate(payloads):
        k, v = codec.decode(payload)
        for i, name in enumerate(LAYER_NAMES):
            layout.scatter(want[name], target[2 * j : 2 * j + 2], k[i], v[i])
    return want


def test_fp8_loads_land_as_each_chunk_decoded_alone_would(store_address):  # noqa: F811
    src = paged_cache(num_blocks=32, seed=19)
    saver = worker(store_address, src, codec="fp8", compile_codec=False)
    keys = chunk_keys(NS.digest(), list(range(4000, 4000 + 3 * CHUNK)), CHUNK)
    saver.save(KVStoreMetadata(saves=[SaveSpec("s", keys, None, list(range(6)))]))
    assert saver.flush(10)
    saver.close()
    dst = paged_cache(num_blocks=32, seed=20)
    w = worker(store_address, dst, codec="fp8", compile_codec=False, load_layerwise=True)
    target = [7, 6, 5, 4, 3, 2]
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, target, 1)]))
    assert w.load_errors() == set()
    want = loaded_the_slow_way(store_address, keys, target, seed=20)
    for name in LAYER_NAMES:
        assert torch.equal(dst[name][target[0]], paged_cache(num_blocks=32, seed=20)[name][7])
        assert all(torch.equal(dst[name][b], want[name][b]) for b in target[1:])
    w.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_fp8_loads_on_the_c_loops_decode_into_the_blocks_as_alone(
    store_address,  # noqa: F811
    monkeypatch,
    transport,
    layerwise,
):
    """With the C loops, a load's whole fp8 chunks are decoded straight into the cache's
    blocks (no batch, no staging copy) and the first, cut chunk through a decode of its
    own: the blocks hold what decoding each chunk alone and scattering it gives, read in
    place in shared memory or fetched over TCP, whole or layer by layer."""
    monkeypatch.setattr(codec._Kernels, "native", codec._Kernels.native)
    src = paged_cache(num_blocks=32, seed=23)
    saver = worker(store_address, src, codec="fp8", compile_codec=True, transport=transport)
    keys = chunk_keys(NS.digest(), list(range(9000, 9000 + 4 * CHUNK)), CHUNK)
    saver.save(KVStoreMetadata(saves=[SaveSpec("s", keys, None, list(range(8)))]))
    assert saver.flush(10)
    saver.close()
    if not codec._Kernels.native:
        pytest.skip("no C compiler: the torch kernels run, tested above")
    dst = paged_cache(num_blocks=32, seed=24)
    w = worker(
        store_address,
        dst,
        codec="fp8",
        compile_codec=True,
        transport=transport,
        load_layerwise=layerwise,
    )
    assert w._defer_fp8
    target = [20, 9, 8, 30, 3, 2, 11, 17]
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, target, 1)]))
    assert w.load_errors() == set()
    assert w.counters.loaded_chunks == 4
    want = loaded_the_slow_way(store_address, keys, target, seed=24)
    untouched = paged_cache(num_blocks=32, seed=24)
    for name in LAYER_NAMES:
        assert torch.equal(dst[name][target[0]], untouched[name][20])  # vLLM's own block
        assert all(torch.equal(dst[name][b], want[name][b]) for b in target[1:])
        others = [b for b in range(32) if b not in target]
        assert torch.equal(dst[name][others], untouched[name][others])
    w.close()
