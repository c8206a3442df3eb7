"""Where a store hit's time goes in the connector: lookup, transfer, decode, copy into blocks.

Usage: ``python benchmarks/hit_profile.py [--quick] [--paired RUNS]``. Prints one line
per case, then one JSON object, also written to ``benchmarks/results/hit_profile.json``.

A ``kvstore serve`` process (DRAM tier) holds prefixes saved by a real ``WorkerHalf``
from a paged CPU cache of ``ttft.py``'s model (2 layers, 1 KV head x 64, float32,
block 32, chunk 256 tokens); a second ``WorkerHalf`` loads them into other blocks, each
stage timed apart as the connector runs it: ``lookup`` (the scheduler's one Lookup with a
lease; on the same host it also says where the store keeps the chunks), ``transfer``
(gRPC Get; on the same host with ``shm`` only checking those places, no call, and with
``shm_copy`` a GetShm and the copy into a staging buffer), ``decode``
(``codec.decode_many``, reading shared memory in place; same-host ``raw`` chunks as one
strided batch of views of the region; fp8 on the C loops only checked here, decoded in
``scatter``), ``scatter`` (into the paged blocks, all whole chunks of a layer in one copy,
or fp8 decoded straight into them; with the check that every chunk's slot still held it
and the lease held). Each repeat loads a prefix of its own, so its bytes are not in the
CPU's caches (a 16K-token load is 16 MiB; the L3 here is 32 MiB: repeating one prefix
measured copies 2-3x faster than an engine sees).
Cases: transport ``tcp``, ``shm_copy`` (shared memory copied into a staging buffer first,
as the connector did before) or ``shm`` x codec ``raw`` or ``fp8`` (fp8 eager, then fused).
Medians of the repeats. ``--paired RUNS`` compares only ``shm_copy`` with ``shm`` at
16K tokens (``--quick``: 4K), the two alternated run by run: on a noisy host the cases
run one after the other drift apart by more than their difference.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit, parser  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.layouts import CpuLayout  # noqa: E402
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec  # noqa: E402
from connector.worker import WorkerHalf  # noqa: E402
from kvstore.core import codec  # noqa: E402
from kvstore.core.keys import Namespace, chunk_keys, part_key  # noqa: E402
from tests.procs import KVSTORE, Served, store_config  # noqa: E402

BLOCK, CHUNK, LAYERS, HEADS, DIM = 32, 256, 2, 1, 64


def worker(store: str, codec_name: str, transport: str, blocks: int) -> WorkerHalf:
    extra = {"store": store, "codec": codec_name, "chunk_tokens": CHUNK, "transport": transport}
    cfg = ConnectorConfig.from_extra({**extra, "compile_codec": False}, BLOCK)
    ns = Namespace("profile", "r0", LAYERS, HEADS, DIM, CHUNK, codec_name, salt="float32")
    w = WorkerHalf(cfg, ns, BLOCK, 0, lambda kv, name: CpuLayout(BLOCK, DIM))
    g = torch.Generator().manual_seed(0)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(blocks, HEADS, BLOCK, 2 * DIM, generator=g)
        for i in range(LAYERS)
    }
    w.register(caches)
    return w


def profile(
    store: str, codec_name: str, transport: str, tokens: int, repeats: int, in_place: bool = True
) -> dict:
    """Each repeat loads a prefix of its own (a new one, as in an engine: none of its bytes
    is in the CPU's caches yet); the first repeat only warms connections and buffers."""
    blocks = tokens // BLOCK
    saver = worker(store, codec_name, "tcp", blocks + 1)
    ns = saver.ns
    prefixes = [
        chunk_keys(ns.digest(), [r * 7 + 3 + t for t in range(tokens)], CHUNK)
        for r in range(repeats + 1)
    ]
    saver.save(
        KVStoreMetadata(
            saves=[SaveSpec(f"p{r}", k, None, list(range(blocks))) for r, k in enumerate(prefixes)]
        )
    )
    saver.flush(120)
    loader = worker(store, codec_name, transport, blocks + 1)
    client = loader.client
    stages: dict[str, list[float]] = {s: [] for s in ("lookup", "transfer", "decode", "scatter")}
    for r, keys in enumerate(prefixes):
        parts = [part_key(k, 0, 1) for k in keys]
        t0 = time.perf_counter()
        # as the connector does: same host, the leased lookup says where the chunks lie
        hit = client.lookup(keys, lease_ttl_s=30.0, shm=in_place and transport == "shm")
        t1 = time.perf_counter()
        # ...and they are read in place in the store's shared memory
        views = loader._shm_views(parts, hit.shm) if in_place else None
        payloads = views.views if views is not None else loader._fetch(parts)
        t2 = time.perf_counter()
        decoded, _ = codec.decode_many(payloads, defer_fp8=loader._defer_fp8)
        decoded.stacked = decoded.stacked or loader._raw_stacked(0, decoded, views)
        t3 = time.perf_counter()
        loader.scatter(decoded, LoadSpec(f"p{r}", keys, list(range(blocks)), 0))
        good = views.end() if views is not None else len(payloads)
        t4 = time.perf_counter()
        if hit.matched != len(keys) or len(payloads) != len(keys) or good != len(keys):
            raise RuntimeError(f"hit {hit.matched}/{len(keys)}, got {len(payloads)}, {good} good")
        if hit.lease_id and hit.shm is None:  # a grant's lease is the reader's to end
            client.release(hit.lease_id)
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[name].append(dt)
    ms = {name: round(1e3 * statistics.median(v[1:]), 3) for name, v in stages.items()}
    saver.close()
    loader.close()
    return {**ms, "total": round(sum(ms.values()), 3)}


def paired(store: str, tokens: int, rounds: int) -> dict:
    """``shm_copy`` against ``shm`` (``raw``, then fused ``fp8``), alternated run by run in
    one store so that the host's drift falls on both: medians of the runs' totals."""
    out: dict[str, dict] = {}
    for codec_name in ("raw", "fp8"):
        if codec_name == "fp8" and not codec.compile_kernels(
            (LAYERS, HEADS, CHUNK, DIM), torch.float32
        ):
            break
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(rounds):
            for in_place in (r % 2 == 0, r % 2 == 1):
                runs[in_place].append(profile(store, codec_name, "shm", tokens, 7, in_place))
        for in_place, got in runs.items():
            name = f"{codec_name}_{'shm' if in_place else 'shm_copy'}_{tokens}"
            out[name] = {s: round(statistics.median(p[s] for p in got), 3) for s in got[0]}
            totals = ", ".join(f"{p['total']:.1f}" for p in got)
            print(f"{name:<22} median total {out[name]['total']:6.2f} ms (runs: {totals})")
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="RUNS",
        help="only compare shm_copy with shm (in place), RUNS runs each, alternated",
    )
    args = p.parse_args()
    lengths, repeats = ([4096], 5) if args.quick else ([4096, 16384], 9)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dram = "1GiB" if args.paired else "512MiB"
        conf = store_config(Path(tmp) / "store.yaml", Path(tmp) / "lmdb", dram=dram)
        store = Served([KVSTORE, "serve", "--config", str(conf)])
        try:
            if args.paired:
                results = paired(store.address, lengths[-1], args.paired)
                emit("hit_profile", {"paired": args.paired, "cases": results}, args.out)
                return
            for fused in (False, True):
                if fused and not codec.compile_kernels((LAYERS, HEADS, CHUNK, DIM), torch.float32):
                    break
                for codec_name in ("raw", "fp8"):
                    if fused and codec_name == "raw":
                        continue
                    # shm_copy: shared memory copied into a staging buffer first, as the
                    # connector did before it read the region in place
                    for transport in ("tcp", "shm_copy", "shm"):
                        for n in lengths:
                            name = f"{codec_name}{'_fused' if fused else ''}_{transport}_{n}"
                            mode, in_place = transport.split("_")[0], transport == "shm"
                            r = profile(store.address, codec_name, mode, n, repeats, in_place)
                            results[name] = r
                            print(
                                f"{name:<20} total {r['total']:7.2f} ms: "
                                + ", ".join(f"{s} {r[s]:.2f}" for s in list(r)[:4]),
                                flush=True,
                            )
        finally:
            store.stop()
    emit("hit_profile", {"quick": args.quick, "repeats": repeats, "cases": results}, args.out)


if __name__ == "__main__":
    main()
