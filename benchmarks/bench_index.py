"""Radix index throughput and memory at 10^4, 10^5 and 10^6 chunks.

Ops, each per chunk: ``insert`` (admission check + add), ``lookup`` (match and
touch of whole chains), ``demote`` (upper-tier eviction to the next tier) and
``evict`` (leaf-only drops from the last tier). ``bytes_per_chunk`` is the
index's own heap per chunk (tracemalloc), keys included.

    python benchmarks/bench_index.py [--quick]
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit, parser  # noqa: E402
from kvstore.server.index import RadixIndex, TierSpec  # noqa: E402

CHAIN = 64  # chunks per prompt: 8K tokens at 128 tokens per chunk
SIZE = 1 << 20
NS = b"\x01" * 32


def build(
    n: int, tiers: list[TierSpec], window: int = 10_000
) -> tuple[RadixIndex, list[list[bytes]], float]:
    """An index of ``n`` chunks; the time is that of its last ``window`` inserts.

    Timing the last inserts measures the rate *at* ``n`` chunks (what a store of
    that size pays per insert), not the average while it grew.
    """
    index = RadixIndex(tiers, high_watermark=1.0, low_watermark=0.9)
    chains = []
    counter = 0
    start_timing = max(0, (n // CHAIN) * CHAIN - window)
    t0 = time.perf_counter()
    for _ in range(n // CHAIN):
        parent = None
        keys = []
        for _ in range(CHAIN):
            if counter == start_timing:
                t0 = time.perf_counter()
            counter += 1
            key = counter.to_bytes(16, "little")
            index.plan_eviction(0, SIZE)
            index.add(key, parent, NS, SIZE, 0)
            keys.append(key)
            parent = key
        chains.append(keys)
    return index, chains, (time.perf_counter() - t0) / (counter - start_timing)


def run_size(n: int, lookups: int, evictions: int) -> dict:
    gc.collect()
    cap = n * SIZE
    index, chains, t_insert = build(n, [TierSpec("dram", cap), TierSpec("nvme", 4 * cap)])
    rng = random.Random(0)
    picks = [rng.choice(chains) for _ in range(max(1, lookups // CHAIN))]

    def lookups() -> float:
        t0 = time.perf_counter()
        for keys in picks:
            index.touch(index.match(keys))
        return time.perf_counter() - t0

    t_lookup = min(lookups() for _ in range(3))  # noise only ever slows a pass

    def evict_from(tier: int) -> tuple[int, float]:
        moved = 0
        t0 = time.perf_counter()
        while moved < evictions:
            plan = index.plan_eviction(tier, SIZE * evictions // 10)
            if not plan.steps:
                break
            for step in plan.steps:
                index.apply(step)
            moved += len(plan.steps)
        return moved, time.perf_counter() - t0

    # squeeze the upper tier so each plan demotes about evictions/10 chunks
    index.tiers[0] = TierSpec("dram", index.used[0])
    demoted, t_demote = evict_from(0)
    index.tiers[1] = TierSpec("nvme", index.used[1])
    dropped, t_evict = evict_from(1)
    return {
        "insert": 1 / t_insert,
        "lookup": len(picks) * CHAIN / t_lookup,
        "demote": demoted / t_demote,
        "evict": dropped / t_evict,
    }


def bytes_per_chunk(n: int) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index, chains, _ = build(n, [TierSpec("dram", n * SIZE), TierSpec("nvme", n * SIZE)])
    del chains
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / len(index)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    sizes = [10**4, 10**5, 10**6]
    lookups, evictions = (20_000, 5_000) if args.quick else (200_000, 50_000)
    ops: dict[str, dict[str, float]] = {}
    for n in sizes:
        rates = run_size(n, lookups, evictions)
        ops[str(n)] = rates
        line = "  ".join(f"{op} {rate / 1e3:8.1f}k/s" for op, rate in rates.items())
        print(f"chunks={n:>8}  {line}", flush=True)
    bpc = bytes_per_chunk(10**5 if args.quick else 10**6)
    print(f"bytes_per_chunk={bpc:.0f}")
    ratios = {op: ops[str(sizes[-1])][op] / ops[str(sizes[0])][op] for op in ops[str(sizes[0])]}
    emit(
        "bench_index",
        {
            "quick": args.quick,
            "ops_per_s": ops,
            "bytes_per_chunk": bpc,
            "ratio_1e6_vs_1e4": ratios,
            "goals": {
                "ops_ratio_ge_0.5": all(r >= 0.5 for r in ratios.values()),
                "bytes_per_chunk_le_300": bpc <= 300,
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
