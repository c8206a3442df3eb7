"""Inter-token latency of a decoding request while another request's long prefix loads
from the store, against the same decode with nothing else arriving.

Usage: ``python benchmarks/itl.py [--quick] [--length 16384] [--rounds N]``. Writes
``benchmarks/results/itl.json`` (also printed as the last line); server logs go to
``benchmarks/results/itl-logs/``.

One ``kvstore serve`` (DRAM) and three vLLM OpenAI servers running the TTFT benchmark's
model (``benchmarks/ttft.py``: Llama-3-8B's compute-to-KV ratios, two layers): node A
prefills each prefix and saves it; node B loads it synchronously (the load runs in the
step that schedules the request, before its forward: every running request waits for
it), node B' with ``load_async`` (the load runs on a loader thread; the request joins the
batch once its blocks are full), and, for reference, node L without a connector, whose
own prefix cache already holds the prefix (the arriving request loads nothing: what an
arrival costs the decode by itself, its tail's prefill). On each of them a streaming
request decodes 192 tokens; after its 32nd token a request with a stored prefix of
``--length`` tokens arrives. Every gap between two streamed tokens of the decoding
request is recorded, split into the gaps while the arriving request was in flight (sent
to first token) and the others. Reported: p99 (and max) of each, and their ratio, per
node, and ``itl_p99_async_over_local``: the gaps during an arrival whose prefix loads
in the background over those during the same arrival found in vLLM's own cache. That
ratio is the goal's (``goal``, at most 1.5): issue 13 asks for a decode's p99 while a
16K prefix loads "vs the same without the load", and the same arrival without a load is
node L's. Against no arrival at all (``itl_p99_ratio_*``) the arrival's own prefill
step, which no store can take away, already costs 2-5x on two cores.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Progress, emit, parser  # noqa: E402
from benchmarks.openai_server import CPU_ENV, OpenAIServer  # noqa: E402
from benchmarks.ttft import (  # noqa: E402
    CHUNK_TOKENS,
    MODEL_DIR,
    ModelBench,
    percentile,
    store_yaml,
)
from tests.procs import KVSTORE, Served, free_port, kv_transfer_config, wait_for_chunks  # noqa: E402

DECODE_TOKENS = 192
ARRIVE_AFTER = 32  # decoded tokens before the loading request is sent
SUFFIX = 16


def connector(store: str, load_async: bool) -> dict:
    return kv_transfer_config(
        store,
        "raw",
        CHUNK_TOKENS,
        lookup_timeout_s=2.0,
        load_timeout_s=30.0,
        save_timeout_s=60.0,
        save_queue_depth=256,
        load_async=load_async,
    )


def stream_times(server: OpenAIServer, prompt: list[int], max_tokens: int, on_token) -> list:
    """Arrival time of every streamed token of one greedy completion."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    for raw in resp:
        if raw.startswith(b"data: {") and b'"choices"' in raw:
            times.append(time.perf_counter())
            on_token(len(times))
    conn.close()
    return times


class Bench(ModelBench):
    def __init__(self, args, work: Path) -> None:
        super().__init__("itl", args, work)
        self.store = None
        self.expected = 0

    def start(self) -> None:
        chunks = 16 + 2 * (self.args.rounds + 1) * (self.args.length // CHUNK_TOKENS)
        self.store = Served(
            [KVSTORE, "serve", "--config", str(store_yaml(self.work / "store.yaml", chunks))]
        )
        max_len = self.args.length + DECODE_TOKENS + 2 * SUFFIX + 64
        for name, kv in (
            ("a", connector(self.store.address, False)),
            ("b_sync", connector(self.store.address, False)),
            ("b_async", connector(self.store.address, True)),
            ("local", None),
        ):
            self.servers[name] = OpenAIServer(
                name,
                self.model,
                free_port(),
                self.logs,
                kv_transfer_config=kv,
                prefix_caching=name == "local",
                max_model_len=max_len,
                server_args=["--max-num-batched-tokens", "2048"],
                env=CPU_ENV,
            )
        for s in self.servers.values():
            s.wait_ready()

    def stored_prefix(self, length: int) -> list[int]:
        """A new prefix that node A served; returns once the store holds its chunks."""
        prefix = self.tokens(length)
        self.servers["a"].ttft(prefix + self.tokens(SUFFIX))
        self.expected += (length + SUFFIX - 1) // CHUNK_TOKENS
        if wait_for_chunks(self.store.address, self.expected, timeout=300) < self.expected:
            raise TimeoutError(f"node A's chunks did not land; see {self.logs}/server-a.log")
        return prefix

    def round(self, node: str, length: int) -> tuple[list[float], list[float], int]:
        """Gaps (ms) of the decoding request while the loading one was in flight, the other
        gaps, and the prompt tokens the loading request reported cached."""
        server = self.servers[node]
        prefix = self.stored_prefix(length)
        if node == "local":  # into its own prefix cache, as node A put it into the store
            server.ttft(prefix + self.tokens(SUFFIX))
        arrive = threading.Event()
        window: dict[str, float] = {}
        result: dict[str, int] = {}

        def loader():
            arrive.wait()
            window["start"] = time.perf_counter()
            _, result["cached"] = server.ttft(prefix + self.tokens(SUFFIX))
            window["end"] = time.perf_counter()

        thread = threading.Thread(target=loader)
        thread.start()
        times = stream_times(
            server,
            self.tokens(64),
            DECODE_TOKENS,
            lambda n: arrive.set() if n == ARRIVE_AFTER else None,
        )
        thread.join()
        during, other = [], []
        for t0, t1 in zip(times, times[1:]):
            inside = t1 >= window["start"] and t0 <= window["end"]
            (during if inside else other).append((t1 - t0) * 1e3)
        return during, other, result["cached"]

    def close(self) -> None:
        for s in self.servers.values():
            try:
                s.stop()
            except Exception as exc:
                print(f"itl: while stopping: {exc!r}", file=sys.stderr)
        if self.store:
            self.store.stop()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=None, help="stored prefix length (tokens)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per node")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="built here when missing")
    args = p.parse_args()
    args.length = args.length or (4096 if args.quick else 16384)
    args.rounds = args.rounds or (2 if args.quick else 5)
    progress = Progress(1 + 3 * (args.rounds + 1), "itl")
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        try:
            bench.start()
            progress.step("servers ready")
            out: dict = {"length": args.length, "rounds": args.rounds, "chunk": CHUNK_TOKENS}
            for node in ("b_sync", "b_async", "local"):
                bench.round(node, 2 * CHUNK_TOKENS)  # warm-up: lazy initialisation
                progress.step(f"{node} warm-up")
                during, other = [], []
                for _ in range(args.rounds):
                    d, o, cached = bench.round(node, args.length)
                    if cached < args.length:
                        raise AssertionError(
                            f"{node}: the loading request reported {cached} cached tokens, "
                            f"expected {args.length}; see {bench.logs}/server-{node}.log"
                        )
                    during += d
                    other += o
                    progress.step(node)
                key = node.removeprefix("b_")
                p99_during, p99_other = percentile(during, 0.99), percentile(other, 0.99)
                out[f"itl_p99_ms_{key}_during_load"] = round(p99_during, 2)
                out[f"itl_max_ms_{key}_during_load"] = round(max(during), 2)
                out[f"itl_p99_ms_{key}_without_load"] = round(p99_other, 2)
                out[f"itl_p50_ms_{key}_without_load"] = round(percentile(other, 0.5), 2)
                out[f"itl_p99_ratio_{key}"] = round(p99_during / p99_other, 2)
                out[f"gaps_during_load_{key}"] = len(during)
            out["itl_p99_async_over_local"] = round(
                out["itl_p99_ms_async_during_load"] / out["itl_p99_ms_local_during_load"], 2
            )
            out["goal"] = {
                "itl_p99_async_over_local": out["itl_p99_async_over_local"],
                "target": "<= 1.5: p99 during an arrival loading its prefix in the background "
                "over p99 during the same arrival found in vLLM's own cache",
                "met": out["itl_p99_async_over_local"] <= 1.5,
            }
        finally:
            bench.close()
    emit("itl", out, args.out)


if __name__ == "__main__":
    main()
