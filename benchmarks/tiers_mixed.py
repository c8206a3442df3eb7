"""Mixed chunk sizes in one DRAM tier: how full it gets before it evicts, and under churn.

Offers ``mixed_run(body, dram_bytes, churn_bytes, max_seconds)``, used by
``bench_tiers.py``. A ``TieredStore`` over a ``DramTier`` and an ``NvmeTier`` (zstd,
write-through, the default watermarks 0.95 / 0.85) takes prompts of random models,
one chunk per put: tiny test-model chunks (4 and 9 KiB), 1 MiB chunks, and
Llama-3-8B 256-token chunks in fp8 (17,170,468 B) and bf16 (33,554,468 B).

Occupancy is payload bytes resident in DRAM over its capacity, taken just before
each admission that made the store evict: the first such moment fills the tier from
empty; under churn (``churn_bytes`` more after it) every such moment is a peak the
tier reached again after earlier evictions freed extents of other sizes. The watermarks
cap it at 0.95 less at most one chunk; the allocator's share of the loss is its 16-byte
key and 512-byte rounding per chunk, and any room it could not use. Chunks the
allocator had to split over several extents are counted as they are admitted. The
census reads the tier's extent table (no public per-chunk census exists).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time

from benchmarks.common import LLAMA8B_CHUNK, chunk_payload
from kvstore.core.keys import Namespace
from kvstore.core.types import ChunkRecord
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier

# name: (codec, source dtype, (layers, kv_heads, tokens, head_dim), weight by count)
SHAPES = {
    "tiny_raw": ("raw", "float16", (2, 1, 16, 32), 3),
    "tiny_fp8": ("fp8", "float16", (2, 2, 16, 64), 3),
    "1MiB_raw": ("raw", "float16", (4, 8, 64, 128), 3),
    "llama8b_fp8": ("fp8", "bfloat16", LLAMA8B_CHUNK, 2),
    "llama8b_bf16": ("raw", "bfloat16", LLAMA8B_CHUNK, 1),
}
PROMPT_CHUNKS = (1, 8)  # chunks per prompt, uniform


def _census(dram: DramTier) -> int:
    """Payload bytes the tier holds."""
    table = dram._table
    keys = table.keys()
    return sum(a.length for k in keys if (a := table.lookup(k)) is not None)


def mixed_run(body, dram_bytes: int, churn_bytes: int, max_seconds: float) -> dict:
    payloads = {
        name: bytes(chunk_payload(codec, dtype, shape, body))
        for name, (codec, dtype, shape, _) in SHAPES.items()
    }
    digests = {
        name: Namespace(f"mixed-{name}", "r0", s[0], s[1], s[3], s[2], codec).digest()
        for name, (codec, _, s, _) in SHAPES.items()
    }
    names, weights = list(SHAPES), [w for *_, w in SHAPES.values()]
    rng = random.Random(0)
    tmp = tempfile.mkdtemp(prefix="bench-mixed-")
    dram = DramTier(dram_bytes)
    nvme = NvmeTier(tmp, map_size=2 * (dram_bytes + churn_bytes) + (1 << 30))
    store = TieredStore([dram, nvme], write_policy="write_through")
    cap = dram.capacity_bytes
    peaks: list[float] = []  # occupancy just before each admission that evicted
    after: list[float] = []  # occupancy after each put, once churn has begun
    admitted = split = 0
    churned = 0
    by_shape = dict.fromkeys(names, 0)
    t0 = time.perf_counter()
    try:
        while churned < churn_bytes and time.perf_counter() - t0 < max_seconds:
            name = rng.choices(names, weights)[0]
            parent = None
            for _ in range(rng.randint(*PROMPT_CHUNKS)):
                key = rng.randbytes(16)
                resident = _census(dram)
                evictions = store.stats().tiers[0].evictions
                res = store.put([ChunkRecord(key, parent, digests[name], payloads[name])])
                if res.stored != 1:
                    raise RuntimeError(f"mixed put of {name} not stored: {res.rejected}")
                parent = key
                admitted += 1
                by_shape[name] += 1
                alloc = dram._table.lookup(key)
                split += alloc is not None and not alloc.contiguous
                if store.stats().tiers[0].evictions > evictions:
                    peaks.append(resident / cap)
                if peaks:
                    churned += len(payloads[name])
                    after.append(_census(dram) / cap)
        elapsed = time.perf_counter() - t0
    finally:
        store.close()
        shutil.rmtree(tmp)
    if not peaks:
        raise RuntimeError("the mixed run never filled the dram tier")
    return {
        "mixed_dram_capacity_bytes": cap,
        "mixed_chunk_bytes": {n: len(p) for n, p in payloads.items()},
        "mixed_chunks_by_shape": by_shape,
        "mixed_dram_occupancy_before_eviction": round(peaks[0], 4),
        "mixed_dram_occupancy_churn_min": round(min(peaks[1:] or peaks), 4),
        "mixed_dram_occupancy_churn_max": round(max(peaks[1:] or peaks), 4),
        "mixed_dram_occupancy_churn_floor": round(min(after), 4),
        "mixed_evicting_puts": len(peaks),
        "mixed_churn_bytes": churned,
        "mixed_chunks_admitted": admitted,
        "mixed_chunks_split": split,
        "mixed_seconds": round(elapsed, 2),
    }


def summary_lines(r: dict) -> list[str]:
    return [
        "mixed  dram occupancy before the first eviction "
        f"{r['mixed_dram_occupancy_before_eviction']:.3f}",
        f"mixed  under churn: before each eviction {r['mixed_dram_occupancy_churn_min']:.3f}-"
        f"{r['mixed_dram_occupancy_churn_max']:.3f}, lowest after one "
        f"{r['mixed_dram_occupancy_churn_floor']:.3f} (low watermark 0.85)",
        f"mixed  {r['mixed_chunks_admitted']} chunks admitted, {r['mixed_chunks_split']} split, "
        f"{r['mixed_evicting_puts']} puts evicted, {r['mixed_seconds']:.1f} s",
    ]
