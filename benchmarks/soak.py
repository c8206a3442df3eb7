"""Soak: many concurrent clients mixing every data RPC against one real `kvstore serve`
whose DRAM tier is small enough that it evicts and demotes all the time.

Usage: ``python benchmarks/soak.py [--quick] [--clients N] [--seconds S]``. Prints
one line per RPC, then one JSON object as the last line (also written to
``benchmarks/results/soak.json``). The full form is 32 clients for 60 s; ``make
test`` runs a short form through ``tests/service/test_soak.py``.

Each client loops over Lookup, Get, shared-memory Get, Put and Delete on chains of
mixed chunk sizes (4 KiB to 4 MiB, four namespaces). Every byte any read returns is
checked against what was put under that key. Reported: calls and p50/p99 per RPC,
unexpected errors (any error at all: a miss is an answer, not an error), wrong
bytes, and the server's memory: peak RSS against the configured capacities (DRAM
region + LMDB map; goal at most 1.2x), and how far the heap grew beyond the idle
store's (messages in flight).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit, parser  # noqa: E402
from kvstore.client import ClientOptions, KVStoreClient  # noqa: E402
from kvstore.core.keys import Namespace, chunk_keys  # noqa: E402
from kvstore.core.payload import ChunkHeader, build_payload, expected_body_len  # noqa: E402
from kvstore.core.types import ChunkRecord  # noqa: E402
from tests.procs import KVSTORE, Served, store_config  # noqa: E402

DRAM = 96 << 20
LMDB_MAP = 8 << 30
# (layers, kv_heads, head_dim, chunk_tokens): 4 KiB, 256 KiB, 1 MiB and 4 MiB of fp16
SHAPES = [(1, 1, 64, 16), (2, 2, 64, 128), (4, 2, 64, 256), (8, 4, 64, 256)]
CHAIN = 4


def namespaces() -> list[tuple[Namespace, list[bytes]]]:
    """Each shape's namespace and a few valid payloads for it (checksummed headers)."""
    out = []
    rng = random.Random(0)
    for layers, heads, dim, tokens in SHAPES:
        ns = Namespace(f"soak-{layers}x{heads}x{dim}", "r0", layers, heads, dim, tokens, "raw")
        body_len = expected_body_len("raw", "float16", (layers, heads, tokens, dim))
        header = ChunkHeader("raw", "float16", layers, heads, tokens, dim, body_len)
        payloads = [bytes(build_payload(header, rng.randbytes(body_len))) for _ in range(3)]
        out.append((ns, payloads))
    return out


class Soak:
    def __init__(self, address: str, seconds: float) -> None:
        self.address = address
        self.deadline = time.monotonic() + seconds
        self.spaces = namespaces()
        self.truth: dict[bytes, bytes] = {}  # every key ever put -> its payload
        self.chains: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.wrong = 0
        self.checked = 0

    def make_chain(self, rng: random.Random) -> list[ChunkRecord]:
        ns, payloads = rng.choice(self.spaces)
        digest = ns.digest()
        tokens = [rng.randrange(50_000) for _ in range(CHAIN * ns.chunk_tokens)]
        keys = chunk_keys(digest, tokens, ns.chunk_tokens)
        return [
            ChunkRecord(k, keys[i - 1] if i else None, digest, rng.choice(payloads))
            for i, k in enumerate(keys)
        ]

    def timed(self, name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        with self.lock:
            self.latency[name].append(dt)
        return out

    def verify(self, keys: list[bytes], got) -> None:
        with self.lock:
            for key, payload in zip(keys, got):
                self.checked += 1
                if bytes(payload) != self.truth[key]:
                    self.wrong += 1

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with KVStoreClient(self.address, ClientOptions(timeout_s=30.0)) as client:
            while time.monotonic() < self.deadline:
                try:
                    self.step(client, rng)
                except Exception as exc:  # every error is unexpected: report, go on
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")

    def step(self, client: KVStoreClient, rng: random.Random) -> None:
        with self.lock:
            known = rng.choice(self.chains) if self.chains else None
        op = rng.random()
        if known is None or op < 0.25:
            records = self.make_chain(rng)
            with self.lock:
                self.truth.update((r.key, r.payload) for r in records)
            result = self.timed("Put", lambda: client.put(records))
            if result.rejected:
                raise AssertionError(f"put rejected {result.rejected[:1]}")
            with self.lock:
                self.chains.append([r.key for r in records])
        elif op < 0.45:
            found = self.timed("Lookup", lambda: client.lookup(known, lease_ttl_s=5))
            if found.lease_id:
                self.timed("Release", lambda: client.release(found.lease_id))
        elif op < 0.70:
            self.verify(known, self.timed("Get", lambda: client.get(known)))
        elif op < 0.95:
            self.verify(known, self.timed("GetShm", lambda: client.get(known, shm=True)))
        else:
            self.timed("Delete", lambda: client.delete([known[rng.randrange(CHAIN)]]))


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def run(clients: int, seconds: float, workdir: Path) -> dict:
    cfg = store_config(workdir / "kvstore.yaml", workdir / "lmdb", dram=f"{DRAM >> 20}MiB")
    served = Served([KVSTORE, "serve", "--config", str(cfg), "--nvme.map-size", str(LMDB_MAP)])
    try:
        idle = rss_kib(served.proc.pid)
        soak = Soak(served.address, seconds)
        threads = [threading.Thread(target=soak.client_loop, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        peak = idle
        while any(t.is_alive() for t in threads):
            now = rss_kib(served.proc.pid)
            if now["VmRSS"] > peak["VmRSS"]:
                peak = now
            time.sleep(0.2)
        for t in threads:
            t.join()
        with KVStoreClient(served.address) as client:
            stats = client.stats()
        code, err = served.stop()
        if code != 0:
            soak.errors.append(f"server exited {code}: {err[-500:]}")
    finally:
        if served.proc.poll() is None:
            served.kill()
    heap_grown = peak["RssAnon"] - idle["RssAnon"]  # in-flight messages, mostly
    per_rpc = {}
    for name, xs in sorted(soak.latency.items()):
        xs.sort()
        per_rpc[name] = {
            "calls": len(xs),
            "p50_ms": round(statistics.median(xs) * 1e3, 3),
            "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3),
        }
    return {
        "clients": clients,
        "seconds": seconds,
        "rpcs": per_rpc,
        "unexpected_errors": len(soak.errors),
        "first_errors": soak.errors[:5],
        "wrong_bytes_chunks": soak.wrong,
        "chunks_verified": soak.checked,
        "evictions": sum(t.evictions for t in stats.tiers),
        "dram_capacity_mib": DRAM >> 20,
        "lmdb_map_mib": LMDB_MAP >> 20,
        "rss_peak_mib": round(peak["VmRSS"] / 1024, 1),
        "rss_vs_capacities": round(peak["VmRSS"] * 1024 / (DRAM + LMDB_MAP), 4),
        "heap_growth_mib": round(heap_grown / 1024, 1),
        "rss_peak_kib": peak,
        "rss_idle_kib": idle,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args()
    clients = args.clients or (8 if args.quick else 32)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as work:
        result = run(clients, seconds, Path(work))
    for name, r in result["rpcs"].items():
        print(
            f"{name:8s} {r['calls']:7d} calls  p50 {r['p50_ms']:8.3f} ms  p99 {r['p99_ms']:8.3f} ms"
        )
    emit("soak", {"quick": args.quick, **result}, args.out)


if __name__ == "__main__":
    main()
