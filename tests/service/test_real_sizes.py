"""Real-model-sized chunks through a store built as ``kvstore serve`` builds it by default.

Three namespaces share one store: Llama-3-8B's KV geometry (32 layers x 8 KV heads x
head_dim 128, 256-token chunks) as fp8 (17,170,468 B a chunk) and as raw bf16 (32 MiB
+ header), and the tiny test model (32 KiB). Every chunk must come back byte for byte
over TCP ``Get`` and over shared memory, first from a warm store, then from a store
reopened on the same LMDB, whose chunks sit only in LMDB.
"""

from __future__ import annotations

import functools

import torch

from kvstore.client import ClientOptions, KVStoreClient
from kvstore.client.shm_writer import Fill
from kvstore.core import codec
from kvstore.core.keys import Namespace, chunk_keys
from kvstore.core.types import ChunkRecord
from kvstore.server.app import limits_of
from kvstore.server.config import load_config
from kvstore.server.factory import build_store
from kvstore.server.metrics import Metrics
from tests.chunks import chain, keys_of, payloads_of

N = 8
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "chunk_tokens": 256}
FP8 = Namespace("meta-llama/Meta-Llama-3-8B", "r0", codec="fp8", **LLAMA3_8B)
BF16 = Namespace("meta-llama/Meta-Llama-3-8B", "r0", codec="raw", **LLAMA3_8B)
FP8_BYTES = 17_170_468
BF16_BYTES = 32 * 2**20 + codec.HEADER_BYTES


def _llama_kv(n: int, seed: int):
    """``n`` chunks of one prompt: each chunk's K and V (bf16), and for the fp8 and the
    raw namespace, the namespace's digest and the chunks' keys."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128_000, (n * LLAMA3_8B["chunk_tokens"],), generator=g).tolist()
    shape = (32, 8, LLAMA3_8B["chunk_tokens"], 128)
    kv = []
    for _ in range(n):  # K, then V, chunk by chunk: the generator's order is the data
        k = torch.randn(shape, generator=g).to(torch.bfloat16)
        v = torch.randn(shape, generator=g).to(torch.bfloat16)
        kv.append((k, v))
    spaces = [
        (name, d.digest(), chunk_keys(d.digest(), tokens, LLAMA3_8B["chunk_tokens"]))
        for name, d in (("fp8", FP8), ("raw", BF16))
    ]
    return kv, spaces


def llama_chains(n: int, seed: int) -> tuple[list[ChunkRecord], list[ChunkRecord]]:
    """The same ``n`` chunks of one prompt's K/V, encoded fp8 and raw bf16 in their own
    namespaces: same tokens, different keys."""
    kv, spaces = _llama_kv(n, seed)
    fp8, raw = (
        [
            ChunkRecord(ks[i], ks[i - 1] if i else None, digest, bytes(codec.encode(k, v, name)))
            for i, (k, v) in enumerate(kv)
        ]
        for name, digest, ks in spaces
    )
    return fp8, raw


def llama_fills(n: int, seed: int) -> tuple[list[Fill], list[Fill]]:
    """``llama_chains``' chunks as ``Fill`` records: each encodes its K/V where it is put."""
    kv, spaces = _llama_kv(n, seed)
    fp8, raw = (
        [
            Fill(
                ks[i],
                ks[i - 1] if i else None,
                digest,
                codec.payload_len(k, v, name),
                functools.partial(codec.encode, k, v, name),
            )
            for i, (k, v) in enumerate(kv)
        ]
        for name, digest, ks in spaces
    )
    return fp8, raw


def default_store(lmdb):
    """The store ``kvstore serve`` builds from the default config, its LMDB in ``lmdb``,
    and the service limits it would serve it with."""
    config = load_config(env={}, overrides={"nvme.path": str(lmdb)})
    return build_store(config), limits_of(config), config.server.max_message_bytes


def serve_default(serve, lmdb):
    store, limits, max_message_bytes = default_store(lmdb)
    return serve(store, limits=limits, max_message_bytes=max_message_bytes)


def read_tcp(client: KVStoreClient, keys: list[bytes], want: list[bytes]) -> None:
    got = client.get(keys)
    assert [len(p) for p in got] == [len(w) for w in want]
    assert all(bytes(p) == w for p, w in zip(got, want))


def read_shm(client: KVStoreClient, keys: list[bytes], want: list[bytes]) -> None:
    got = client.get(keys, shm=True)
    assert [len(p) for p in got] == [len(w) for w in want]
    assert all(bytes(p) == w for p, w in zip(got, want))
    dests = [torch.empty(len(w), dtype=torch.uint8) for w in want]
    assert client.get_shm_into(keys, dests) == len(keys)
    for dest, w in zip(dests, want):
        assert torch.equal(dest, torch.frombuffer(bytearray(w), dtype=torch.uint8))


def read_back(
    address: str, chains: list[list[ChunkRecord]], shm_first: bool
) -> tuple[list[str], int]:
    """Every chain over TCP ``Get``, ``get(shm=True)`` and ``get_shm_into`` torch tensors,
    each compared byte for byte with what was put. Returns where Lookup placed the
    chunks and how many copies came straight from shared memory."""
    where: list[str] = []
    with KVStoreClient(address, ClientOptions(timeout_s=120.0)) as client:
        for records in chains:
            keys, want = keys_of(records), payloads_of(records)
            found = client.lookup(keys)
            assert found.matched == len(keys), (found.matched, found.tiers)
            where += found.tiers
            for read in (read_shm, read_tcp) if shm_first else (read_tcp, read_shm):
                read(client, keys, want)
        assert client.stats().active_leases == 0
        return where, client.shm_stats.chunks


def test_default_store_round_trips_llama3_8b_fp8_bf16_and_tiny_chunks(serve, tmp_path):
    fp8, bf16 = llama_chains(N, seed=1)
    tiny = chain(N, seed=2)
    chains = [fp8, bf16, tiny]
    assert {len(r.payload) for r in fp8} == {FP8_BYTES}
    assert {len(r.payload) for r in bf16} == {BF16_BYTES}
    lmdb = tmp_path / "lmdb"

    served = serve_default(serve, lmdb)
    with KVStoreClient(served.address, ClientOptions(timeout_s=120.0)) as client:
        for records in chains:
            put = client.put(records)
            assert (put.stored, put.rejected) == (N, []), put
    where, from_shm = read_back(served.address, chains, shm_first=False)
    assert set(where) == {"dram"}, where  # 2 GiB of DRAM holds all of them
    assert from_shm == 2 * 3 * N  # both shm reads of every chunk, none redone over TCP
    served.server.stop()

    # reopened on the same LMDB: the index comes back from it, the bytes come from it
    served = serve_default(serve, lmdb)
    assert len(served.store.index) == 3 * N
    where, _ = read_back(served.address, chains, shm_first=True)
    assert set(where) == {"nvme"}, where
    with KVStoreClient(served.address) as client:
        nvme = next(t for t in client.stats().tiers if t.name == "nvme")
        assert nvme.hits >= 3 * N


def test_same_host_puts_of_llama3_8b_chunks_land_byte_for_byte(serve, tmp_path):
    """The client's copies into shared memory go in 4 MiB pieces over several threads,
    and the store checks large batches on several threads: every byte must still land."""
    fp8, bf16 = llama_chains(4, seed=3)
    tiny = chain(4, seed=4)
    store, limits, max_message_bytes = default_store(tmp_path / "lmdb")
    metrics = Metrics(store.stats)
    served = serve(store, limits=limits, max_message_bytes=max_message_bytes, metrics=metrics)
    with KVStoreClient(served.address, ClientOptions(timeout_s=120.0)) as client:
        for records in (fp8, bf16, tiny):
            put = client.put(records, shm=True)
            assert (put.stored, put.rejected) == (4, []), put
            read_tcp(client, keys_of(records), payloads_of(records))
        assert client.stats().put_chunks == 12

    def calls(method: str) -> float | None:
        labels = {"method": method, "code": "OK"}
        return metrics.registry.get_sample_value("kvstore_rpc_total", labels)

    assert (calls("CommitShm"), calls("Put")) == (3, None)  # all of it over shared memory
    served.server.stop()


def test_llama3_8b_chunks_encoded_straight_into_shared_memory_read_back_as_encoded(serve, tmp_path):
    """The connector's same-host saves: each chunk's payload is encoded into its room in
    the store's region (``Fill``), checked by the commit like any put, and written
    through; it must read back as the same chunk encoded into a buffer of its own."""
    fills = llama_fills(3, seed=5)
    chains = llama_chains(3, seed=5)
    store, limits, max_message_bytes = default_store(tmp_path / "lmdb")
    metrics = Metrics(store.stats)
    served = serve(store, limits=limits, max_message_bytes=max_message_bytes, metrics=metrics)
    with KVStoreClient(served.address, ClientOptions(timeout_s=120.0)) as client:
        for put, records in zip(fills, chains, strict=True):
            assert [f.key for f in put] == keys_of(records)
            result = client.put(put, shm=True)
            assert (result.stored, result.rejected) == (3, []), result
            read_tcp(client, keys_of(records), payloads_of(records))
        assert sorted(t.chunks for t in client.stats().tiers) == [6, 6]  # dram and nvme
    calls = metrics.registry.get_sample_value
    assert calls("kvstore_rpc_total", {"method": "CommitShm", "code": "OK"}) == 2
    assert calls("kvstore_rpc_total", {"method": "Put", "code": "OK"}) is None  # none by wire
