"""Lookup latency over TCP loopback, idle and while another process streams 64 MiB puts
(and idle over the store's same-host socket).

Offers ``start_store(tmp, put_bytes)`` (the store under test as ``kvstore serve`` runs
it, put process included, started in the benchmark's server process), ``tiered_store``
(the same store without gRPC or put process, for the bound's second store),
``lookup_latency(target, idle_calls, puts, max_seconds)`` (run by the benchmark), and
``put_stream`` (the putting client, a process of its own so that its encoding does not
share a GIL with the timed lookups).

The store is a DRAM tier (512 MiB) over an NVMe tier (zstd, write-through), so a put
parses and checksums its chunks, copies them into DRAM, compresses and commits them to
LMDB, and evicts from DRAM once the stream has filled it. The client sends its puts to
the store's put process (the port ``Routes`` names), which does all of that but the
eviction and the index's bookkeeping outside the store's process. Four real 512-key chains of
small chunks are stored, to 512, 496, 480 and 448 keys; each lookup asks for one whole
chain (round robin) and must match exactly the stored prefix. Each put is a 2-chunk chain
of Llama-3-8B 256-token bf16 chunks (33,554,468 B each, 64 MiB per put; the default
``server.max_chunk_bytes`` is 64 MiB, so one chunk cannot carry the whole 64 MiB).
Latencies are measured idle (same key lists, same calls) and then for as long as the put
process is putting; ``puts`` and ``max_seconds`` bound it. The client sends each Llama
chunk in 1 MiB parts (its defaults: ``put_part_bytes`` 1 MiB for chunks over
``put_split_bytes``, 4 MiB): the Python gRPC server turns each received message into one
``bytes`` with the GIL held, so the message size, not the put size, sets how long a lookup
can be held up. The same chunks are then put in 4 MiB parts (the client's default
before), whole, one 32 MiB message each (``put_part_bytes=0``, as clients did before
parts), and as 1 MiB chunks (64 per put, sent in 4 MiB messages). Then the Llama chunks
are put over shared memory (same host), where no payload crosses gRPC at all (the
store's own ``CommitShm`` checks and persists them). Then the first stream once more,
to the store's own ``Put`` (``_to_store``): the store as it was before it had a put
process. Last, the bound: the same 1 MiB-part stream goes to a second store of the same kind in a
process of its own (``_elsewhere`` keys), so the timed lookups share the host's two
cores with all of a put's work but not their store's process (its GIL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import LLAMA8B_CHUNK, chain, chunk_len, chunk_payload
from kvstore.client import ClientOptions, KVStoreClient
from kvstore.core.keys import Namespace

SMALL = Namespace("bench-service-small", "r0", 1, 1, 8, 16, "raw")  # 512 B per chunk
LOOKUP_KEYS = 512
STORED = (512, 496, 480, 448)  # the stored prefix of each lookup chain
# what one 64 MiB put carries: (namespace, chunk shape (layers, kv_heads, tokens, head_dim),
# chunks, over shared memory, the client's put_part_bytes); bf16 K+V, so a chunk is 4 x its
# shape's product, plus a header. put_part_bytes None is the client's default; 0 sends each
# chunk whole in one message, as clients did before parts.
PUTS = {
    "llama8b_bf16": (
        Namespace("bench-llama8b", "r0", 32, 8, 128, 256, "raw"),
        LLAMA8B_CHUNK,
        2,
        False,
        None,
    ),
    "llama8b_bf16_4mib_parts": (
        Namespace("bench-llama8b-4mib", "r0", 32, 8, 128, 256, "raw"),
        LLAMA8B_CHUNK,
        2,
        False,
        4 << 20,
    ),
    "llama8b_bf16_whole": (
        Namespace("bench-llama8b-whole", "r0", 32, 8, 128, 256, "raw"),
        LLAMA8B_CHUNK,
        2,
        False,
        0,
    ),
    "llama8b_bf16_to_store": (
        Namespace("bench-llama8b-to-store", "r0", 32, 8, 128, 256, "raw"),
        LLAMA8B_CHUNK,
        2,
        False,
        None,
    ),
    "1MiB": (
        Namespace("bench-1mib", "r0", 4, 8, 128, 64, "raw"),
        (4, 8, 64, 128),
        64,
        False,
        None,
    ),
    "llama8b_bf16_shm": (
        Namespace("bench-llama8b-shm", "r0", 32, 8, 128, 256, "raw"),
        LLAMA8B_CHUNK,
        2,
        True,
        None,
    ),
}
DRAM_BYTES = 512 << 20


def start_store(tmp: str, put_bytes: int):
    """The lookup store as ``kvstore serve`` runs it (``kvstore.server.app``): the store of
    ``tiered_store`` behind its gRPC server and its put process, which serves ``Put`` on
    a port of its own. Returns the ``Running`` once the put process serves."""
    from kvstore.server import app
    from kvstore.server.config import load_config

    config = load_config(
        env={},
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.metrics_listen": "",
            "server.grace_s": 1.0,
            "dram.capacity_bytes": DRAM_BYTES,
            "nvme.path": tmp,
            "nvme.map_size": nvme_bytes(put_bytes),
            "nvme.compression": "zstd",
            "store.write_policy": "write_through",
        },
    )
    running = app.start(config)
    deadline = time.monotonic() + 60
    while not running.server.service.put_port:
        if time.monotonic() > deadline:
            running.stop()
            raise RuntimeError("the store's put process did not start")
        time.sleep(0.05)
    return running


def nvme_bytes(put_bytes: int) -> int:
    return 2 * put_bytes + (1 << 30)


def tiered_store(tmp: str, put_bytes: int):
    """DRAM over LMDB with zstd, write-through: what a put pays for, under the writer lock."""
    from kvstore.server.store import TieredStore
    from kvstore.server.tiers.dram import DramTier
    from kvstore.server.tiers.nvme import NvmeTier

    nvme = NvmeTier(tmp, map_size=nvme_bytes(put_bytes), compression="zstd")
    return TieredStore([DramTier(DRAM_BYTES), nvme], write_policy="write_through")


def put_bytes(puts: int) -> int:
    """Bytes ``puts`` 64 MiB puts of every kind store."""
    return sum(puts * n * chunk_len("raw", "bfloat16", shape) for _, shape, n, *_ in PUTS.values())


def put_stream(
    conn, target: str, kind: str, puts: int, seconds: float, first_seed: int = 10_000
) -> None:
    """Child process: build one bf16 chunk, say ready, then put 64 MiB chains on "go"."""
    ns, shape, per_put, shm, part_bytes = PUTS[kind]
    n = 2 * int(np.prod(shape))  # K and V elements
    normal = np.random.default_rng(5).standard_normal(n, dtype=np.float32)
    bf16 = (normal.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16, truncated
    payload = bytes(chunk_payload("raw", "bfloat16", shape, bf16.view(np.uint8)))
    times: list[tuple[float, float]] = []
    errors: list[str] = []
    # "_to_store": the puts go to the store's own Put, not its put process (as before it)
    options = ClientOptions(timeout_s=120.0, route_puts=not kind.endswith("_to_store"))
    if part_bytes is not None:
        options = dataclasses.replace(options, put_part_bytes=part_bytes)
    with KVStoreClient(target, options) as client:
        client.ping()
        conn.send("ready")
        conn.recv()
        deadline = time.monotonic() + seconds
        for i in range(puts):
            if time.monotonic() > deadline:
                break
            records = chain(ns, [payload] * per_put, seed=first_seed + i)
            t0 = time.perf_counter()
            try:
                res = client.put(records, shm=shm)
                if res.stored + res.duplicates != per_put or res.rejected:
                    errors.append(f"put {i}: stored {res.stored}, rejected {res.rejected[:1]}")
            except Exception as exc:  # counted, none expected
                errors.append(f"put {i}: {type(exc).__name__}: {exc}"[:200])
            times.append((t0, time.perf_counter()))
    conn.send({"times": times, "errors": errors, "put_bytes": per_put * len(payload)})


def _store_chains(client: KVStoreClient) -> list[tuple[list[bytes], int]]:
    rng = np.random.default_rng(3)
    chunk = bytes(chunk_payload("raw", "float16", (1, 1, 16, 8), rng.bytes(512)))
    out = []
    for i, stored in enumerate(STORED):
        records = chain(SMALL, [chunk] * LOOKUP_KEYS, seed=40 + i)
        if client.put(records[:stored]).stored != stored:
            raise RuntimeError("lookup setup: a chain was not stored")
        out.append(([r.key for r in records], stored))
    return out


def _timed_lookups(client, chains, until) -> tuple[list[float], int]:
    lat, wrong, i = [], 0, 0
    while not until(len(lat)):
        keys, want = chains[i % len(chains)]
        i += 1
        t0 = time.perf_counter()
        matched = client.lookup(keys).matched
        lat.append(time.perf_counter() - t0)
        wrong += matched != want
    return lat, wrong


def _pct(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {
        "p50": statistics.median(s) * 1e3,
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3,
        "max": s[-1] * 1e3,
    }


def _under_puts(
    client,
    chains,
    target: str,
    kind: str,
    puts: int,
    seconds: float,
    idle: int,
    first_seed: int = 10_000,
):
    """Lookups while a put process streams; ``idle`` > 0 first times that many without it.

    ``first_seed`` picks the chains put: repeating one puts duplicates.
    """
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    putter = ctx.Process(
        target=put_stream, args=(child_conn, target, kind, puts, seconds, first_seed)
    )
    putter.start()
    try:
        if conn.recv() != "ready":
            raise RuntimeError("the put process did not start")
        quiet = _timed_lookups(client, chains, lambda n: n >= idle) if idle else ([], 0)
        conn.send("go")
        # every lookup that starts while puts are in flight; bounded by the put process
        busy = _timed_lookups(client, chains, lambda n: conn.poll())
        report = conn.recv()
    finally:
        putter.join(30)
        if putter.is_alive():
            putter.kill()
    return quiet, busy, report


def _put_figures(busy: tuple[list[float], int], report: dict, tag: str) -> dict:
    times = report["times"]
    span = times[-1][1] - times[0][0] if times else 0.0
    p = _pct(busy[0])
    return {
        f"lookup_p50_under_put{tag}_ms": round(p["p50"], 3),
        f"lookup_p99_under_put{tag}_ms": round(p["p99"], 3),
        f"lookup_max_under_put{tag}_ms": round(p["max"], 3),
        f"lookup_under_put{tag}_calls": len(busy[0]),
        f"put_stream{tag}_puts": len(times),
        f"put_stream{tag}_bytes_per_put": report["put_bytes"],
        f"put_stream{tag}_gbps": round(len(times) * report["put_bytes"] / span / 1e9, 3)
        if span
        else 0.0,
        f"put_stream{tag}_put_ms_p50": round(statistics.median(e - s for s, e in times) * 1e3, 1),
        f"put_stream{tag}_errors": report["errors"][:5],
    }


def _other_store(conn, put_bytes_: int) -> None:
    """Child process: a store like the lookup store, for the put stream of the bound."""
    from kvstore.server.grpc_server import StoreServer

    tmp = tempfile.mkdtemp(prefix="bench-lookup-other-")
    try:
        server = StoreServer(tiered_store(tmp, put_bytes_), "127.0.0.1:0", grace_s=1.0)
        conn.send(server.start())
        conn.recv()
        server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _puts_elsewhere(client, chains, puts: int, max_seconds: float):
    """Lookups of ``client``'s store while the 1 MiB-part stream goes to another store."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    other = ctx.Process(target=_other_store, args=(child_conn, put_bytes(puts)), daemon=True)
    other.start()
    try:
        if not conn.poll(60):
            raise RuntimeError("the second store did not start")
        target = f"127.0.0.1:{conn.recv()}"
        return _under_puts(client, chains, target, "llama8b_bf16", puts, max_seconds, 0)
    finally:
        with contextlib.suppress(OSError):  # a store that died first hears nothing
            conn.send("stop")
        other.join(30)
        if other.is_alive():
            other.kill()


def lookup_latency(target: str, idle_calls: int, puts: int, max_seconds: float) -> dict:
    """Lookup p50/p99 idle, then under six streams of 64 MiB puts, over gRPC; then idle
    over the store's same-host socket (``_idle_local``).

    Keys without a tag: Llama-3-8B bf16 chunks over TCP, each in 1 MiB parts;
    ``_4mib_parts``: the same in 4 MiB parts;
    ``_whole_chunks``: the same, one 32 MiB gRPC message per chunk;
    ``_1mib_chunks``: the same bytes as 1 MiB chunks (4 MiB messages);
    ``_shm``: Llama chunks again, copied by the client into the store's shared memory
    (``put(shm=True)``), so no payload crosses gRPC;
    ``_to_store``: the first stream again, sent to the store's own ``Put`` instead of its
    put process (``route_puts=False``), as every put went before the put process;
    ``_elsewhere``: the first stream again, into a second store in another process (the
    bound: the same load on the host's cores, none on the lookup store's process).
    """
    # over gRPC, as the store's other-host clients (and its same-host ones before the
    # same-host socket) look up; the socket's idle figures are taken after, for comparison
    with KVStoreClient(target, ClientOptions(local_calls=False)) as client:
        chains = _store_chains(client)
        _timed_lookups(client, chains, lambda n: n >= 20)  # warm up
        idle, big, big_report = _under_puts(
            client, chains, target, "llama8b_bf16", puts, max_seconds, idle_calls
        )
        _, four, four_report = _under_puts(
            client, chains, target, "llama8b_bf16_4mib_parts", puts, max_seconds, 0
        )
        _, whole, whole_report = _under_puts(
            client, chains, target, "llama8b_bf16_whole", puts, max_seconds, 0
        )
        _, small, small_report = _under_puts(client, chains, target, "1MiB", puts, max_seconds, 0)
        _, shm, shm_report = _under_puts(
            client, chains, target, "llama8b_bf16_shm", puts, max_seconds, 0
        )
        _, itself, itself_report = _under_puts(
            client, chains, target, "llama8b_bf16_to_store", puts, max_seconds, 0
        )
        _, elsewhere, elsewhere_report = _puts_elsewhere(client, chains, puts, max_seconds)
    with KVStoreClient(target) as local:
        _timed_lookups(local, chains, lambda n: n >= 20)  # warm up
        socket_idle = _timed_lookups(local, chains, lambda n: n >= idle_calls)
    p = _pct(idle[0])
    q = _pct(socket_idle[0])
    return {
        "lookup_p50_idle_ms": round(p["p50"], 3),
        "lookup_p99_idle_ms": round(p["p99"], 3),
        "lookup_max_idle_ms": round(p["max"], 3),
        "lookup_idle_calls": len(idle[0]),
        "lookup_p50_idle_local_ms": round(q["p50"], 3),
        "lookup_p99_idle_local_ms": round(q["p99"], 3),
        **_put_figures(big, big_report, ""),
        **_put_figures(four, four_report, "_4mib_parts"),
        **_put_figures(whole, whole_report, "_whole_chunks"),
        **_put_figures(small, small_report, "_1mib_chunks"),
        **_put_figures(shm, shm_report, "_shm"),
        **_put_figures(itself, itself_report, "_to_store"),
        **_put_figures(elsewhere, elsewhere_report, "_elsewhere"),
        "lookup_wrong_matches": sum(
            run[1] for run in (idle, big, four, whole, small, shm, itself, elsewhere, socket_idle)
        ),
    }
