"""What a same-host save costs the connector, with Llama-3-8B-sized chunks.

Usage: ``python benchmarks/save_path.py [--quick]``. Prints one line per case, then one
JSON object, also written to ``benchmarks/results/save_path.json``.

Two stages, each the way the connector runs it now against the way it ran before, the
two alternated round by round (medians; the host's noise moves both alike):

- ``gather``, on the engine's thread (``wait_for_save``): one 256-token chunk of a
  paged CPU cache (vLLM's CPU layout, bf16, 32 layers x 8 KV heads x 128, blocks of
  32) copied out as ``[layers, H, T, D]`` K and V. ``stack``: each layer gathered into
  tensors of its own, then ``torch.stack``; ``into``: each layer gathered straight into
  its slice of fresh tensors (``gather(out=)``); ``reused``: the same into tensors a sent
  chunk left (the connector keeps a few: no page faults). The copies are dropped on
  another thread, as the connector's sender drops them; the thread's page faults are
  counted.
- ``send``, on the connector's sender thread: ``--chunks`` such chunks encoded (``fp8``:
  16.4 MiB a chunk; ``raw``: 32 MiB) and put into a ``kvstore serve`` on this host
  (DRAM only). ``copy``: encoded into buffers of their own, then copied into the store's
  shared memory (``put(shm=True)`` of ``ChunkRecord``s); ``fill``: encoded straight into
  their rooms there (``shm_writer.Fill``). The thread's minor page faults are counted.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import LLAMA8B_CHUNK, Progress, emit, parser  # noqa: E402
from connector.layouts import CpuLayout  # noqa: E402
from kvstore.client import ClientOptions, KVStoreClient  # noqa: E402
from kvstore.client.shm_writer import Fill  # noqa: E402
from kvstore.core import codec  # noqa: E402
from kvstore.core.keys import Namespace, chunk_keys  # noqa: E402
from kvstore.core.types import ChunkRecord  # noqa: E402
from tests.procs import KVSTORE, Served  # noqa: E402

LAYERS, HEADS, TOKENS, DIM = LLAMA8B_CHUNK
BLOCK = 32


def _drop_elsewhere(holder: list) -> None:
    """Empty ``holder``, the only owner of its items, on another thread: where the
    connector's sender frees a chunk's copies."""
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()


def gather_cases(rounds: int, progress: Progress) -> dict:
    g = torch.Generator().manual_seed(0)
    blocks = 4 * TOKENS // BLOCK  # room for four chunks: each round reads other blocks
    caches = [
        torch.randn(blocks, HEADS, BLOCK, 2 * DIM, generator=g).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    layout = CpuLayout(BLOCK, DIM)

    def stack(ids):
        ks, vs = zip(*(layout.gather(c, ids) for c in caches))
        return torch.stack(ks), torch.stack(vs)

    shape = (LAYERS, HEADS, TOKENS, DIM)
    spare = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))

    def into(ids, reuse=False):
        k, v = spare if reuse else (torch.empty(shape, dtype=torch.bfloat16) for _ in range(2))
        for i, c in enumerate(caches):
            layout.gather(c, ids, out=(k[i], v[i]))
        return k, v

    per = TOKENS // BLOCK
    a, b = stack(list(range(per))), into(list(range(per)))
    if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
        raise AssertionError("the two gathers disagree")
    times: dict[str, list[float]] = {"stack": [], "into": [], "reused": []}
    faults: dict[str, list[int]] = {name: [] for name in times}
    cases = (("stack", stack), ("into", into), ("reused", functools.partial(into, reuse=True)))
    for r in range(rounds):
        ids = list(range((r % 4) * per, (r % 4 + 1) * per))
        for name, fn in cases:
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t0 = time.perf_counter()
            out = [fn(ids)]
            times[name].append((time.perf_counter() - t0) * 1e3)
            faults[name].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
            _drop_elsewhere(out)
        progress.step("gather")
    result = {f"gather_{n}_ms": round(statistics.median(t), 2) for n, t in times.items()}
    result.update({f"gather_{n}_faults": int(statistics.median(f)) for n, f in faults.items()})
    return result


def send_cases(address: str, chunks: int, rounds: int, progress: Progress) -> dict:
    g = torch.Generator().manual_seed(1)
    kv = [
        (
            torch.randn(LLAMA8B_CHUNK, generator=g).to(torch.bfloat16),
            torch.randn(LLAMA8B_CHUNK, generator=g).to(torch.bfloat16),
        )
        for _ in range(chunks)
    ]
    codec.compile_kernels(LLAMA8B_CHUNK, torch.bfloat16)
    out: dict = {}
    with KVStoreClient(address, ClientOptions(timeout_s=120.0)) as client:
        for name in ("fp8", "raw"):
            out.update(_send_codec(client, name, kv, rounds, progress))
    return out


def _records(name: str, kv: list, keys: list[bytes], digest: bytes, fill: bool) -> list:
    made: list[ChunkRecord | Fill] = []
    for i, (k, v) in enumerate(kv):
        parent = keys[i - 1] if i else None
        if fill:
            write = functools.partial(codec.encode, k, v, name)
            made.append(Fill(keys[i], parent, digest, codec.payload_len(k, v, name), write))
        else:
            made.append(ChunkRecord(keys[i], parent, digest, codec.encode(k, v, name)))
    return made


def _send_codec(client: KVStoreClient, name: str, kv: list, rounds: int, progress) -> dict:
    chunks = len(kv)
    digest = Namespace("save-path", "r0", LAYERS, HEADS, DIM, TOKENS, name).digest()
    keys = chunk_keys(digest, list(range(chunks * TOKENS)), TOKENS)
    want = bytes(codec.encode(*kv[-1], name))

    def save(fill: bool, result: dict) -> None:
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t0 = time.perf_counter()
        put = client.put(_records(name, kv, keys, digest, fill), shm=True)
        result["ms"] = (time.perf_counter() - t0) * 1e3
        result["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        if put.stored != chunks:
            raise RuntimeError(f"stored {put.stored}/{chunks}: {put.rejected[:1]}")

    runs: dict[str, list[dict]] = {"copy": [], "fill": []}
    for _ in range(rounds):
        for case in ("copy", "fill"):
            result: dict = {}
            sender = threading.Thread(target=save, args=(case == "fill", result))
            sender.start()
            sender.join()
            if "ms" not in result:
                raise RuntimeError(f"the {name} {case} save failed")
            if bytes(client.get(keys)[-1]) != want:
                raise RuntimeError("a saved chunk reads back different bytes")
            client.delete([keys[0]])
            runs[case].append(result)
        progress.step(f"send {name}")
    out: dict = {}
    for case, rs in runs.items():
        out[f"save_{name}_{case}_ms"] = round(statistics.median(r["ms"] for r in rs), 1)
        out[f"save_{name}_{case}_faults"] = int(statistics.median(r["faults"] for r in rs))
    out[f"save_{name}_fill_over_copy"] = round(
        out[f"save_{name}_fill_ms"] / out[f"save_{name}_copy_ms"], 3
    )
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=None, help="chunks per save (default 6)")
    args = p.parse_args()
    chunks = args.chunks or (4 if args.quick else 6)
    rounds = 5 if args.quick else 9
    progress = Progress(3 * rounds, "save_path")
    result: dict = {"chunks": chunks, "rounds": rounds}
    result.update(gather_cases(rounds, progress))
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "store.yaml"
        room = 2 * chunks * (32 << 20) + (64 << 20)  # two raw saves' worth, and a margin
        conf.write_text(
            "server:\n  listen: 127.0.0.1:0\n  metrics_listen: ''\n"
            f"dram:\n  capacity_bytes: {room}\nnvme:\n  enabled: false\n"
        )
        store = Served([KVSTORE, "serve", "--config", str(conf)])
        try:
            result.update(send_cases(store.address, chunks, rounds, progress))
        finally:
            store.stop()
    progress.done()
    stack = result["gather_stack_ms"]
    result["gather_into_over_stack"] = round(result["gather_into_ms"] / stack, 3)
    result["gather_reused_over_stack"] = round(result["gather_reused_ms"] / stack, 3)
    for key, value in result.items():
        print(f"{key:32} {value}")
    emit("save_path", result, args.out)


if __name__ == "__main__":
    main()
