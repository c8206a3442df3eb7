"""Crash consistency: kill -9 a real `kvstore serve` again and again during heavy Put
traffic, restart it on the same data, and check what it kept.

Usage: ``python benchmarks/crash_loop.py [--quick] [--restarts N] [--policy P]``.
Prints one line per restart, then one JSON object as the last line (also written to
``benchmarks/results/crash_loop.json``). ``make test`` runs the quick form through
``tests/service/test_crash_loop.py``; the full form (20 restarts per policy) is run
by hand.

Per restart, writer threads put chains of 1 MiB chunks (valid payloads, LMDB with
``nvme.sync`` off) until the store is killed mid-traffic. After the restart:

- ``write_through``: every chunk whose Put was acknowledged before the kill is read
  back byte for byte (a Put is acknowledged only once it is committed to LMDB).
- ``write_back``: acknowledged chunks that only DRAM held at the kill are lost, by
  design; what survives is byte-identical, and every surviving chain is a prefix of
  what was put (LMDB never holds a suffix without its prefix).
- Both: the index is rebuilt, no corrupt value is served (the checksum counters are
  reported), and ``kvstore stats`` agrees with what the store serves.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit, parser  # noqa: E402
from kvstore.client import ClientError, ClientOptions, KVStoreClient  # noqa: E402
from kvstore.core import codec  # noqa: E402
from kvstore.core.keys import Namespace, chunk_keys  # noqa: E402
from kvstore.core.types import ChunkRecord  # noqa: E402
from tests.procs import KVSTORE, Served, free_port, store_config  # noqa: E402

NS = Namespace("crash-loop", "r0", 4, 2, 64, 512, "raw")  # 1 MiB fp16 chunks
CHAIN = 4
WRITERS = 3
KEEP_CHAINS = 300  # checked again after the next kill too; older ones are deleted
PATIENT = ClientOptions(timeout_s=30.0, retries=10)


def payload_pool(n: int) -> list[bytes]:
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (NS.num_layers, NS.num_kv_heads, NS.chunk_tokens, NS.head_dim)
    return [
        bytes(
            codec.encode(torch.randn(shape, generator=g).half(), torch.randn(shape).half(), "raw")
        )
        for _ in range(n)
    ]


@dataclass
class Ledger:
    """Chains whose Put was acknowledged, and each chunk's bytes."""

    acked: list[list[ChunkRecord]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, records: list[ChunkRecord]) -> None:
        with self.lock:
            self.acked.append(records)


def make_chain(rng: random.Random, pool: list[bytes]) -> list[ChunkRecord]:
    tokens = [rng.randrange(50_000) for _ in range(CHAIN * NS.chunk_tokens)]
    digest = NS.digest()
    keys = chunk_keys(digest, tokens, NS.chunk_tokens)
    return [
        ChunkRecord(k, keys[i - 1] if i else None, digest, rng.choice(pool))
        for i, k in enumerate(keys)
    ]


def traffic(address: str, ledger: Ledger, pool: list[bytes], seed: int, stop: threading.Event):
    rng = random.Random(seed)
    with KVStoreClient(address, ClientOptions(timeout_s=10.0, retries=0)) as client:
        while not stop.is_set():
            records = make_chain(rng, pool)
            try:
                result = client.put(records)
            except ClientError:
                return  # the store died under this call: nothing of it was acknowledged
            if result.stored + result.duplicates == len(records):
                ledger.add(records)


def check_restart(address: str, ledger: Ledger, policy: str) -> dict:
    """Read every acknowledged chain back; returns what survived and what was lost."""
    kept = lost = wrong = 0
    with KVStoreClient(address, PATIENT) as client:
        for records in ledger.acked:
            got = client.get([r.key for r in records])
            for payload, rec in zip(got, records):
                if bytes(payload) != rec.payload:
                    wrong += 1
            kept += len(got)
            lost += len(records) - len(got)
        stats = client.stats()
    evicted = next(t.evictions for t in stats.tiers if t.name == "nvme")
    if evicted:
        raise AssertionError(f"LMDB evicted {evicted} chunks: the check needs a larger map")
    if policy == "write_through" and lost:
        raise AssertionError(f"write_through lost {lost} acknowledged chunks")
    if wrong:
        raise AssertionError(f"{wrong} chunks came back with the wrong bytes")
    corrupt = sum(t.corrupt for t in stats.tiers)
    resident = next(t.chunks for t in stats.tiers if t.name == "nvme")
    if stats.chunks < kept or resident != stats.chunks:
        raise AssertionError(
            f"stats disagree: {stats.chunks} chunks, {resident} in nvme, {kept} acknowledged read"
        )
    return {"kept": kept, "lost": lost, "corrupt_counted": corrupt, "chunks": stats.chunks}


def forget(address: str, ledger: Ledger, keep: int) -> None:
    """Delete all but the newest ``keep`` checked chains, so LMDB never fills (and evicts)."""
    old, ledger.acked = ledger.acked[:-keep], ledger.acked[-keep:]
    if old:
        with KVStoreClient(address, PATIENT) as client:
            client.delete([records[0].key for records in old])


def run(policy: str, restarts: int, traffic_s: float, workdir: Path) -> dict:
    pool = payload_pool(8)
    # a small DRAM tier, so write_back demotes (and so persists) part of every round
    cfg = store_config(workdir / "kvstore.yaml", workdir / "lmdb", dram="8MiB")
    port = free_port()
    argv = [
        KVSTORE,
        "serve",
        "--config",
        str(cfg),
        "--server.listen",
        f"127.0.0.1:{port}",
        "--store.write-policy",
        policy,
        "--nvme.map-size",
        "4GiB",
    ]
    ledger = Ledger()
    rounds = []
    rng = random.Random(policy)
    for n in range(restarts + 1):
        served = Served(argv)
        t0 = time.monotonic()
        try:
            round_ = {"restart": n, **check_restart(served.address, ledger, policy)}
        except BaseException:
            served.stop()  # a failed check must not leave the store running
            raise
        round_["check_s"] = round(time.monotonic() - t0, 3)
        if n == restarts:
            code, err = served.stop()
            assert code == 0, err
            rounds.append(round_)
            print(f"{policy} final check: {round_}", flush=True)
            break
        if policy == "write_back":  # what the kill will take is not ours to read back
            ledger.acked.clear()
        forget(served.address, ledger, keep=KEEP_CHAINS)
        stop = threading.Event()
        writers = [
            threading.Thread(
                target=traffic, args=(served.address, ledger, pool, 1000 * n + w, stop)
            )
            for w in range(WRITERS)
        ]
        before = len(ledger.acked)
        for w in writers:
            w.start()
        time.sleep(traffic_s * rng.uniform(0.5, 1.5))
        served.proc.kill()  # SIGKILL, mid-traffic
        served.proc.wait(timeout=30)
        stop.set()
        for w in writers:
            w.join(60)
        round_["acked_puts"] = len(ledger.acked) - before
        rounds.append(round_)
        print(f"{policy} restart {n}: {round_}", flush=True)
    return {
        "policy": policy,
        "restarts": restarts,
        "acked_chunks": sum(r.get("acked_puts", 0) for r in rounds) * CHAIN,
        "lost_chunks": sum(r["lost"] for r in rounds),
        "corrupt_counted": max(r["corrupt_counted"] for r in rounds),
        "rounds": rounds,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--restarts", type=int, default=None, help="kills per policy (20; quick: 3)")
    p.add_argument("--policy", choices=["write_through", "write_back"], action="append")
    args = p.parse_args()
    restarts = args.restarts or (3 if args.quick else 20)
    traffic_s = 0.6 if args.quick else 1.5
    results = {}
    for policy in args.policy or ["write_through", "write_back"]:
        with tempfile.TemporaryDirectory(prefix="kvstore-crash-") as work:
            results[policy] = run(policy, restarts, traffic_s, Path(work))
    emit("crash_loop", {"quick": args.quick, "pid": os.getpid(), **results}, args.out)


if __name__ == "__main__":
    main()
