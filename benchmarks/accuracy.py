"""Accuracy gate for lossy codecs: does KV loaded through the store still answer right?

Usage: ``python benchmarks/accuracy.py [--quick] [--retrain] [--lengths 1024,2048,4096]``.
Writes ``benchmarks/results/accuracy.json`` (also printed as the last line).

The model is a tiny Llama trained here on a recall task (``recall_task.py``): a
prefix of 1-4K tokens hides 64 key-value pairs among filler, and each question
after it names a key whose value must be recalled exactly. For every example the
prefix is prefilled once; its KV cache (post-RoPE keys, as vLLM stores them) is cut
into 256-token chunks, encoded with a codec, Put into a real ``kvstore serve``
process (DRAM + LMDB), Got back, decoded, and the questions are answered on top
of it. Codecs:

- ``raw``: the cache bit for bit (must equal the no-store reference exactly).
- ``fp8``: kvstore's fp8 (e4m3, per-channel K scales, per-token V scales).
- ``fp8_naive``: reference only, not a kvstore codec: one scale per layer for the K
  (or V) of a chunk, cast to e4m3 and back, then stored ``raw``.

Reported: ``accuracy[codec]`` (fraction of questions answered right, greedy),
per prefix length, and the mean |logprob delta| of the answer tokens against
``raw``. Gate: ``fp8`` within 1 point (absolute) of ``raw``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import RESULTS, Progress, emit, parser  # noqa: E402
from benchmarks.recall_task import MODEL_DIR, haystack_batch, load_or_train  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.core import codec as kvcodec  # noqa: E402
from kvstore.core.keys import Namespace, chunk_keys  # noqa: E402
from kvstore.core.types import ChunkRecord  # noqa: E402
from tests.procs import KVSTORE, Served, store_config  # noqa: E402

CHUNK_TOKENS = 256
QUESTIONS = 64
CODECS = ["raw", "fp8", "fp8_naive"]
GATE_POINTS = 1.0


def fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """The naive cast: one scale for the whole tensor, e4m3, and back."""
    scale = x.abs().amax().clamp_min(1e-12) / kvcodec.FP8_MAX
    return (x / scale).to(kvcodec.FP8).float() * scale


class StoreRoundTrip:
    """Chunks of a prefix's KV through a real store process and back."""

    def __init__(self, work: Path, model, tag: str) -> None:
        cfg = store_config(work / "store.yaml", work / "lmdb", dram="256MiB")
        self.store = Served([KVSTORE, "serve", "--config", str(cfg)])
        self.client = KVStoreClient(self.store.address)
        c = model.config
        self.namespaces = {
            name: Namespace(
                model=tag,
                revision="bench",
                num_layers=c.num_hidden_layers,
                num_kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                chunk_tokens=CHUNK_TOKENS,
                codec="fp8" if name == "fp8" else "raw",
                salt=name,
            ).digest()
            for name in CODECS
        }
        self.bytes_put = dict.fromkeys(CODECS, 0)

    def round_trip(self, name: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor):
        """K/V ``[layers, heads, tokens, dim]`` of a chunk-aligned prefix, after the store."""
        ns = self.namespaces[name]
        keys = chunk_keys(ns, tokens, CHUNK_TOKENS)
        records = []
        for i, key in enumerate(keys):
            sl = slice(i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS)
            ck, cv = k[:, :, sl].contiguous(), v[:, :, sl].contiguous()
            if name == "fp8_naive":  # one scale per layer's K (or V) in this chunk
                ck = torch.stack([fp8_per_tensor(layer) for layer in ck])
                cv = torch.stack([fp8_per_tensor(layer) for layer in cv])
            payload = kvcodec.encode(ck, cv, "fp8" if name == "fp8" else "raw")
            self.bytes_put[name] += len(payload)
            records.append(ChunkRecord(key, keys[i - 1] if i else None, ns, bytes(payload)))
        result = self.client.put(records)
        if result.rejected:
            raise RuntimeError(f"the store refused chunks: {result.rejected[:3]}")
        payloads = self.client.get(keys)
        if len(payloads) != len(keys):  # a short cache would count as codec error
            raise RuntimeError(f"the store returned {len(payloads)} of {len(keys)} chunks")
        parts = [kvcodec.decode(bytes(p)) for p in payloads]
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def close(self) -> None:
        self.client.close()
        self.store.stop()


def answer(model, cache_kv, tokens: torch.Tensor, prefix: int, labels: torch.Tensor):
    """Logprobs over the vocabulary at the question positions, with the prefix from ``cache_kv``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    k, v = cache_kv
    for layer in range(k.shape[0]):
        cache.update(k[layer].unsqueeze(0), v[layer].unsqueeze(0), layer)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, prefix:], past_key_values=cache).logits
    at = (labels[:, prefix:] != -100)[0]
    return torch.log_softmax(logits[0, at].float(), dim=-1), labels[0, prefix:][at]


def prefix_kv(model, tokens: torch.Tensor, prefix: int):
    with torch.no_grad():
        out = model(input_ids=tokens[:, :prefix], use_cache=True)
    layers = out.past_key_values.layers
    k = torch.stack([layer.keys[0] for layer in layers])
    v = torch.stack([layer.values[0] for layer in layers])
    return k, v


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096", help="prefix lengths (tokens)")
    p.add_argument("--samples", type=int, default=None, help="examples per length")
    p.add_argument("--retrain", action="store_true", help="train the model again")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up in logs as it happens
    lengths = [int(n) for n in args.lengths.split(",")]
    for n in lengths:
        if n % CHUNK_TOKENS:
            p.error(f"--lengths: {n} is not a multiple of the chunk size {CHUNK_TOKENS}")
    samples = args.samples or (8 if args.quick else 32)
    started = time.monotonic()
    model, task, record = load_or_train(args.model_dir, args.retrain)
    gen = torch.Generator().manual_seed(args.seed)
    correct = {c: {n: 0 for n in lengths} for c in ["no_store", *CODECS]}
    delta_sum = dict.fromkeys(CODECS, 0.0)
    asked = dict.fromkeys(lengths, 0)
    raw_exact = True
    with tempfile.TemporaryDirectory(prefix="kvstore-acc-") as tmp:
        store = StoreRoundTrip(Path(tmp), model, f"recall-llama-{record['seed']}")
        progress = Progress(len(lengths) * samples, "accuracy")
        try:
            for n in lengths:
                for _ in range(samples):
                    tokens, labels = haystack_batch(task, gen, 1, n, QUESTIONS)
                    kv = prefix_kv(model, tokens, n)
                    ref_lp, truth = answer(model, kv, tokens, n, labels)
                    correct["no_store"][n] += int((ref_lp.argmax(-1) == truth).sum())
                    asked[n] += len(truth)
                    for name in CODECS:  # raw first: the others are compared with it
                        loaded = store.round_trip(name, tokens[0, :n].tolist(), *kv)
                        lp, _ = answer(model, loaded, tokens, n, labels)
                        correct[name][n] += int((lp.argmax(-1) == truth).sum())
                        answer_lp = lp.gather(-1, truth[:, None]).squeeze(-1)
                        if name == "raw":
                            raw_exact &= bool(torch.equal(lp, ref_lp))
                            raw_answer_lp = answer_lp
                        delta_sum[name] += float((answer_lp - raw_answer_lp).abs().sum())
                    progress.step(f"prefix {n}")
            progress.done()
        finally:
            store.close()

    total = sum(asked.values())
    tokens_stored = samples * sum(lengths)
    accuracy = {c: sum(v.values()) / total for c, v in correct.items()}
    gap = 100 * abs(accuracy["fp8"] - accuracy["raw"])
    result = {
        "accuracy": {c: round(a, 4) for c, a in accuracy.items()},
        "accuracy_by_prefix": {
            c: {str(n): round(v[n] / asked[n], 4) for n in lengths} for c, v in correct.items()
        },
        "logprob_delta_vs_raw": {c: round(delta_sum[c] / total, 5) for c in CODECS},
        "raw_equals_no_store": raw_exact,
        "questions": total,
        "chance": round(1 / task.n_values, 4),
        "payload_bytes_per_token": {
            c: round(b / tokens_stored) for c, b in store.bytes_put.items()
        },
        "gate": {
            "fp8_minus_raw_points": round(100 * (accuracy["fp8"] - accuracy["raw"]), 2),
            "target": f"|fp8 - raw| <= {GATE_POINTS} point",
            "met": gap <= GATE_POINTS and raw_exact,
        },
        "training": record,
        "wall_s": round(time.monotonic() - started, 1),
    }
    emit("accuracy", result, args.out or RESULTS / "accuracy.json")


if __name__ == "__main__":
    main()
