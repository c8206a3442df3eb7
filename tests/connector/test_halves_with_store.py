"""Both connector halves against a real store server, with a real paged CPU cache tensor.

No engine here: the requests are plain records carrying what vLLM's would (an id
and prompt token ids), and the cache is a tensor in vLLM's CPU layout. The real
vLLM runs are in ``test_vllm_e2e.py``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from connector.config import ConnectorConfig
from connector.layouts import CpuLayout
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from connector.scheduler import SchedulerHalf
from connector.worker import WorkerHalf
from kvstore.client import KVStoreClient
from kvstore.core.keys import Namespace, chunk_keys
from kvstore.server.grpc_server import StoreServer
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.proxy import FaultyProxy

BLOCK, CHUNK, LAYERS, HEADS, DIM = 32, 64, 2, 2, 32
NS = Namespace("tiny", "r0", LAYERS, HEADS, DIM, CHUNK, "raw", salt="kv_dtype=float32")


@pytest.fixture
def store_address():
    store = TieredStore([DramTier(64 << 20)])
    server = StoreServer(store, "127.0.0.1:0")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


def config(address: str, **kw) -> ConnectorConfig:
    return ConnectorConfig.from_extra(
        {"store": address, "codec": "raw", "chunk_tokens": CHUNK, **kw}, BLOCK
    )


def paged_cache(num_blocks: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            num_blocks, HEADS, BLOCK, 2 * DIM, generator=g
        )
        for i in range(LAYERS)
    }


def worker(address: str, caches, **kw) -> WorkerHalf:
    w = WorkerHalf(config(address, **kw), NS, BLOCK, 0, lambda kv, name: CpuLayout(BLOCK, DIM))
    w.register(caches)
    return w


def test_saved_chunks_load_into_other_blocks_exactly(store_address):
    tokens = list(range(1000, 1000 + 4 * CHUNK))
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    src = paged_cache(seed=1)
    saver = worker(store_address, src)
    saver.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, [3, 4, 5, 6, 7, 8, 9, 10])]))
    assert saver.flush(10) and saver.counters.saved_chunks == 4

    dst = paged_cache(seed=2)
    before = {n: t.clone() for n, t in dst.items()}
    loader = worker(store_address, dst)
    # blocks 12 and 13 already hold this request's first chunk (vLLM's own prefix cache)
    loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, [12, 13, 0, 1, 2, 5, 6, 7], 2)]))
    assert loader.load_errors() == set()
    layout = CpuLayout(BLOCK, DIM)
    for name in src:
        want_k, want_v = layout.gather(src[name], [5, 6, 7, 8, 9, 10])
        got_k, got_v = layout.gather(dst[name], [0, 1, 2, 5, 6, 7])
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        # blocks before first_block and blocks outside the plan are untouched
        for b in (12, 13, 3, 4, 8):
            assert torch.equal(dst[name][b], before[name][b])
    assert loader.counters.loaded_tokens == 6 * BLOCK
    saver.close()
    loader.close()


def test_a_sent_chunk_s_copies_carry_the_next_saves_and_every_chunk_stays_its_own(
    store_address,
):
    """The K/V copied out for a save are reused for the next saves once sent (fresh ones
    page-faulted on the engine's thread); what each save stored must still be its own
    blocks' bytes, read back by loading every chunk into another cache."""
    src = paged_cache(seed=3)
    saver = worker(store_address, src)
    first = chunk_keys(NS.digest(), list(range(2 * CHUNK)), CHUNK)
    saver.save(KVStoreMetadata(saves=[SaveSpec("a", first, None, [0, 1, 2, 3])]))
    assert saver.flush(10) and saver.counters.saved_chunks == 2
    spare = sorted(k.data_ptr() for k, _ in saver._spare)
    assert len(spare) == 2  # both chunks' copies, kept once sent
    then = chunk_keys(NS.digest(), list(range(1, 1 + 2 * CHUNK)), CHUNK)
    saver.save(KVStoreMetadata(saves=[SaveSpec("b", then, None, [8, 9, 10, 11])]))
    assert saver.flush(10) and saver.counters.saved_chunks == 4
    assert sorted(k.data_ptr() for k, _ in saver._spare) == spare  # gathered into them
    saved = [(first, [0, 1, 2, 3]), (then, [8, 9, 10, 11])]
    assert_loads_back(store_address, src, saved, [[4, 5, 6, 7], [12, 13, 14, 15]])
    saver.close()


def assert_loads_back(address, src, saved, landed) -> None:
    """Each of ``saved``'s (keys, blocks of ``src``) loads into ``landed``'s blocks of
    another cache as exactly those blocks."""
    dst = paged_cache(seed=9)
    loader = worker(address, dst)
    loads = [LoadSpec(f"r{i}", keys, b, 0) for i, ((keys, _), b) in enumerate(zip(saved, landed))]
    loader.load(KVStoreMetadata(loads=loads))
    assert loader.load_errors() == set()
    layout = CpuLayout(BLOCK, DIM)
    for name in src:
        for (_, blocks), into in zip(saved, landed, strict=True):
            want_k, want_v = layout.gather(src[name], blocks)
            got_k, got_v = layout.gather(dst[name], into)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    loader.close()


class HeldClient(KVStoreClient):
    """The real client, whose puts wait until the test lets them go: a store slow to take
    a save, without timing anything."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, records, timeout_s=None, *, shm=False):
        self.entered.set()
        assert self.release.wait(30)
        return super().put(records, timeout_s, shm=shm)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_save_made_while_the_last_is_being_put_never_gathers_into_its_copies(
    store_address, transport
):
    src = paged_cache(seed=5)
    client = HeldClient(store_address)
    saver = WorkerHalf(
        config(store_address, transport=transport),
        NS,
        BLOCK,
        0,
        lambda kv, name: CpuLayout(BLOCK, DIM),
        client=client,
    )
    saver.register(src)
    keys = [chunk_keys(NS.digest(), list(range(i, i + 2 * CHUNK)), CHUNK) for i in range(3)]
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    client.release.set()
    saver.save(KVStoreMetadata(saves=[SaveSpec("a", keys[0], None, blocks[0])]))
    assert saver.flush(10) and len(saver._spare) == 2  # sent: its copies are spare now
    client.entered.clear()
    client.release.clear()
    saver.save(KVStoreMetadata(saves=[SaveSpec("b", keys[1], None, blocks[1])]))
    assert client.entered.wait(10)  # b's copies (a's spares) are being put, held there
    saver.save(KVStoreMetadata(saves=[SaveSpec("c", keys[2], None, blocks[2])]))
    client.release.set()
    assert saver.flush(10) and saver.counters.saved_chunks == 6
    landed = [[12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert_loads_back(store_address, src, list(zip(keys, blocks)), landed)
    saver.close()


def test_chunks_of_another_shape_under_the_keys_are_not_loaded(store_address):
    """Whatever a store holds under a prefix's keys, chunks whose shape is not the engine's
    (here a model with one layer more: each layer alone would fit the engine's blocks) are
    refused whole: every block is left to compute and none is written."""
    from kvstore.core import codec
    from kvstore.core.types import ChunkRecord

    keys = chunk_keys(NS.digest(), list(range(7000, 7000 + 2 * CHUNK)), CHUNK)
    k = torch.randn(LAYERS + 1, HEADS, CHUNK, DIM)
    payload = bytes(codec.encode(k, -k, "raw"))
    records = [ChunkRecord(keys[0], None, NS.digest(), payload)]
    records.append(ChunkRecord(keys[1], keys[0], NS.digest(), payload))
    with KVStoreClient(store_address) as client:
        assert client.put(records).stored == 2
    dst = paged_cache(seed=5)
    before = {n: t.clone() for n, t in dst.items()}
    loader = worker(store_address, dst)
    loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, [4, 5, 6, 7], 0)]))
    assert loader.load_errors() == {4, 5, 6, 7}
    assert all(torch.equal(dst[n], before[n]) for n in dst)
    assert loader.counters.loaded_chunks == 0
    loader.close()


def test_a_short_load_reports_exactly_the_blocks_it_could_not_fill(store_address):
    tokens = list(range(4 * CHUNK))
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    src = paged_cache(seed=3)
    saver = worker(store_address, src)
    saver.save(KVStoreMetadata(saves=[SaveSpec("a", keys[:2], None, [0, 1, 2, 3])]))
    saver.flush(10)
    loader = worker(store_address, paged_cache(seed=4))
    loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, list(range(8, 16)), 0)]))
    assert loader.load_errors() == {12, 13, 14, 15}
    assert loader.load_errors() == set()  # reported once
    assert loader.counters.load_failures == 1


def test_a_dead_store_fails_every_planned_block_without_raising():
    loader = worker("127.0.0.1:1", paged_cache(), load_timeout_s=0.5)
    keys = chunk_keys(NS.digest(), list(range(2 * CHUNK)), CHUNK)
    loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, [4, 5, 6, 7], 1)]))
    assert loader.load_errors() == {5, 6, 7}


def test_a_chunk_of_another_geometry_is_not_loaded(store_address):
    keys = chunk_keys(NS.digest(), list(range(CHUNK)), CHUNK)
    other = Namespace("tiny", "r0", LAYERS, 1, DIM, CHUNK, "raw")  # one head, not two
    caches = {n: t[:, :1].contiguous() for n, t in paged_cache().items()}
    w = WorkerHalf(config(store_address), other, BLOCK, 0, lambda kv, n: CpuLayout(BLOCK, DIM))
    w.register(caches)
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, [0, 1])]))
    w.flush(10)
    loader = worker(store_address, paged_cache())
    loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, [2, 3], 0)]))
    assert loader.load_errors() == {2, 3}


def test_a_full_save_queue_skips_instead_of_waiting(store_address):
    keys = chunk_keys(NS.digest(), list(range(8 * CHUNK)), CHUNK)
    w = worker(store_address, paged_cache(), save_queue_depth=1)
    w._queue.put_nowait(("x", None, None, None))  # occupy the queue: the sender is not running
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, list(range(16)))]))
    assert w.counters.save_skipped == 8


def request(req_id: str, tokens: list[int]):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens)


def stored_prompt(address: str, first: int) -> tuple[list[int], WorkerHalf]:
    """A 3-chunk prompt whose chunks a worker saved to the store (the worker is returned
    for closing)."""
    tokens = list(range(first, first + 3 * CHUNK))
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    w = worker(address, paged_cache())
    w.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, list(range(6)))]))
    w.flush(10)
    return tokens, w


def test_scheduler_reports_whole_stored_chunks_and_leaves_a_token(store_address):
    tokens, w = stored_prompt(store_address, 500)
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    # the whole prompt is stored, but one token must be left to compute: 2 chunks, not 3
    assert sched.matched_tokens(request("r1", tokens), 0) == 2 * CHUNK
    # with 64 tokens already computed locally only the rest is reported
    assert sched.matched_tokens(request("r2", tokens + [7]), CHUNK) == 2 * CHUNK
    assert sched.matched_tokens(request("r3", [1] * CHUNK + tokens), 0) == 0  # first differs
    with KVStoreClient(store_address) as client:
        assert client.stats().active_leases == 2  # r1 and r2 hold theirs
        sched.finished(request("r1", tokens))
        sched.finished(request("r2", tokens))
        assert sched.client.wait_releases(5)  # sent by the client's background releaser
        assert client.stats().active_leases == 0
    sched.close()


class LeaseCountingClient(KVStoreClient):
    """A real client that counts the lookups asking for a lease."""

    leased = 0

    def lookup(self, keys, lease_ttl_s: float = 0.0, *args, **kw):
        self.leased += lease_ttl_s > 0
        return super().lookup(keys, lease_ttl_s, *args, **kw)


def test_no_lease_for_a_prefix_vllms_own_cache_already_covers(store_address):
    tokens, w = stored_prompt(store_address, 700)
    client = LeaseCountingClient(store_address)
    sched = SchedulerHalf(config(store_address), NS, BLOCK, client=client)
    # every loadable chunk (2: one token is left to compute) is already computed here
    assert sched.matched_tokens(request("local", tokens), 2 * CHUNK) == 0
    assert client.leased == 0
    assert sched.matched_tokens(request("store", tokens), CHUNK) == CHUNK
    assert client.leased == 1
    sched.close()
    w.close()


def test_a_release_the_store_has_not_answered_does_not_hold_up_the_step(store_address):
    """vLLM ends a request's leases in the step it finishes, before that step's tokens go
    out: the Release is sent by the client's background releaser, never waited for there."""
    tokens, w = stored_prompt(store_address, 900)
    proxy = FaultyProxy(int(store_address.rsplit(":", 1)[1]))
    sched = SchedulerHalf(config(f"127.0.0.1:{proxy.port}", lookup_timeout_s=30), NS, BLOCK)
    try:
        assert sched.matched_tokens(request("r1", tokens), 0) == 2 * CHUNK
        proxy.mode = "stall"  # the store's answers are held back from here on
        sched.finished(request("r1", tokens))  # returns: a synchronous Release would hang
        assert not sched.client.wait_releases(0.5), "the Release was answered through a stall"
        with KVStoreClient(store_address) as client:
            assert client.stats().active_leases == 1
            proxy.mode = "pass"  # the held Release goes on
            assert sched.client.wait_releases(10)
            assert client.stats().active_leases == 0
    finally:
        proxy.mode = "pass"
        sched.close()
        proxy.close()
        w.close()


def test_scheduler_gives_zero_quickly_when_the_store_is_down():
    sched = SchedulerHalf(config("127.0.0.1:1", lookup_timeout_s=0.3), NS, BLOCK)
    assert sched.matched_tokens(request("r", list(range(4 * CHUNK))), 0) == 0
    assert sched.lookup_failures == 1


def test_scheduler_plans_saves_as_chunks_complete(store_address):
    sched = SchedulerHalf(config(store_address), NS, BLOCK)
    tokens = list(range(3 * CHUNK + 10))
    sched.matched_tokens(request("r", tokens), 0)
    new = SimpleNamespace(req_id="r", block_ids=([7, 8, 9],), num_computed_tokens=0)
    empty = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    # chunked prefill: 100 tokens this step -> one full chunk
    meta = sched.build_meta(
        SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=empty, num_scheduled_tokens={"r": 100}
        )
    )
    assert [(s.keys, s.parent, s.block_ids) for s in meta.saves] == [
        ([chunk_keys(NS.digest(), tokens, CHUNK)[0]], None, [7, 8])
    ]
    cached = SimpleNamespace(
        req_ids=["r"],
        resumed_req_ids=set(),
        new_block_ids=[([10, 11, 12],)],
        num_computed_tokens=[100],
    )
    meta = sched.build_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"r": len(tokens) - 100},
        )
    )
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    assert [(s.keys, s.parent, s.block_ids) for s in meta.saves] == [
        (keys[1:3], keys[0], [9, 10, 11, 12])
    ]
    sched.close()


def test_with_tensor_parallelism_a_chunk_hits_only_when_every_rank_stored_its_part(
    store_address,
):
    ns2 = Namespace("tiny", "r0", LAYERS, 2 * HEADS, DIM, CHUNK, "raw", tp_size=2)
    tokens = list(range(3 * CHUNK))
    keys = chunk_keys(ns2.digest(), tokens, CHUNK)

    def rank_worker(rank: int) -> WorkerHalf:
        w = WorkerHalf(config(store_address), ns2, BLOCK, rank, lambda kv, n: CpuLayout(BLOCK, DIM))
        w.register(paged_cache(seed=rank))
        return w

    sched = SchedulerHalf(config(store_address), ns2, BLOCK)
    rank0, rank1 = rank_worker(0), rank_worker(1)
    rank0.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, list(range(6)))]))
    rank0.flush(10)
    assert sched.matched_tokens(request("r1", tokens), 0) == 0  # rank 1's parts are missing
    rank1.save(KVStoreMetadata(saves=[SaveSpec("a", keys[:1], None, [0, 1])]))
    rank1.flush(10)
    assert sched.matched_tokens(request("r2", tokens), 0) == CHUNK  # both ranks: chunk 0 only
    sched.close()


@pytest.mark.parametrize("transport", ["shm", "tcp", "auto"])
def test_same_host_loads_and_saves_go_through_shared_memory_and_match_tcp(store_address, transport):
    tokens = list(range(7000, 7000 + 2 * CHUNK))
    keys = chunk_keys(NS.digest(), tokens, CHUNK)
    src = paged_cache(seed=5)
    saver = worker(store_address, src, transport=transport)
    saver.save(KVStoreMetadata(saves=[SaveSpec("a", keys, None, [1, 2, 3, 4])]))
    assert saver.flush(10) and saver.counters.saved_chunks == 2

    dst = paged_cache(seed=6)
    loader = worker(store_address, dst, transport=transport)
    for _ in range(2):  # the second load reuses the staging buffer
        loader.load(KVStoreMetadata(loads=[LoadSpec("b", keys, [8, 9, 10, 11], 0)]))
        assert loader.load_errors() == set()
    layout = CpuLayout(BLOCK, DIM)
    for name in src:
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                layout.gather(src[name], [1, 2, 3, 4]), layout.gather(dst[name], [8, 9, 10, 11])
            )
        )
    via_shm = loader.client.shm_stats.chunks
    assert via_shm == (0 if transport == "tcp" else 4)


@pytest.mark.parametrize(
    ("store", "same_host"),
    [
        ("127.0.0.1:1", True),
        ("localhost:1", True),
        ("unix:/tmp/s", True),
        ("[::1]:1", True),
        ("ipv4:127.0.0.1:1", True),
        ("127.0.0.1:1,[::1]:2", True),
        ("10.0.0.7:1", False),
        ("127.0.0.1:1,10.0.0.7:1", False),
        ("localhost.example.com:1", False),
        ("dns:localhost:1", False),
    ],
)
def test_auto_transport_uses_shared_memory_only_for_local_addresses(store, same_host):
    assert config(store).same_host is same_host
    assert config(store, transport="tcp").same_host is False


def test_an_unknown_transport_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="kv_connector_extra_config.transport must be one of"):
        config("127.0.0.1:1", transport="rdma")
