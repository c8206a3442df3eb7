"""Disaggregated prefill/decode behind vllm-router, and single-flight prefill, measured.

Usage: ``python benchmarks/pd.py [--quick] [--length 4096] [--requests N] [--burst N]``.
Writes ``benchmarks/results/pd.json`` (also printed as the last line); server and router
logs go to ``benchmarks/results/pd-logs/``.

One ``kvstore serve`` (DRAM tier) and vLLM OpenAI servers with the connector (``raw``),
the ttft benchmark's model (Llama-3-8B's compute-to-KV ratio), all started here:

(i) P/D: vllm-router 0.1.17 (``--vllm-pd-disaggregation``) in front of a prefill server
    ``p`` and a decode server ``d``, against one ``colocated`` server (its own namespace
    salt, so it never meets P/D's chunks) on the same new prompts, one at a time. For
    each: time to the first token streamed back through the router (the decode side's
    TTFT: the prefill leg, the handoff, the decode server's load and its first token) and
    the colocated server's; and the prompt tokens each server computed (vLLM's
    ``vllm:prompt_tokens_by_source{source="local_compute"}``: prompt minus prefix-cache
    and connector hits).
(ii) Single-flight: one new prompt sent at once to N servers with ``single_flight`` on
    (``p``, ``d`` and more) and then to N servers with it off (salt ``off``): prompt
    tokens computed in total by each group. Goal: with ≈ 1/N of without.

Every prompt is ``--length`` tokens plus a 16-token tail, so its last chunk is partial.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Progress, emit, parser  # noqa: E402
from benchmarks.openai_server import CPU_ENV, OpenAIServer, scrape  # noqa: E402
from benchmarks.router import Router  # noqa: E402
from benchmarks.ttft import CHUNK_TOKENS, MODEL_DIR, ModelBench, connector, store_yaml  # noqa: E402
from tests.procs import KVSTORE, Served, free_port  # noqa: E402

TAIL = 16
MAX_TOKENS = 8
COMPUTED = "vllm:prompt_tokens_by_source_total{local_compute}"
PROMPT = "vllm:prompt_tokens_total"
COUNTERS = ("reservations", "waits", "wait_timeouts", "hit_tokens", "loaded_tokens")


def stream(port: int, prompt: list[int], timeout_s: float = 600) -> tuple[float, str]:
    """Seconds to the first streamed token of a greedy completion, and its whole text."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:500]!r}")
    first, text = None, []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        for choice in json.loads(line[len(b"data: ") :]).get("choices") or ():
            if first is None:
                first = time.perf_counter() - t0
            text.append(choice.get("text") or "")
    conn.close()
    if first is None:
        raise RuntimeError(f"port {port}: the stream ended without a token")
    return first, "".join(text)


class Counted:
    """What a set of servers' /metrics gained while a block ran; waits until every server
    has recorded the prompts it was sent (vLLM records a step's stats after answering)."""

    def __init__(self, servers: dict[str, OpenAIServer]) -> None:
        self.servers = servers
        self.before = {n: scrape(s.port) for n, s in servers.items()}

    def gained(self, prompt_tokens: dict[str, int], timeout_s: float = 30) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            now = {n: scrape(s.port) for n, s in self.servers.items()}
            done = all(
                now[n].get(PROMPT, 0) - self.before[n].get(PROMPT, 0) >= want
                for n, want in prompt_tokens.items()
            )
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        names = [COMPUTED] + [f"vllm:kvstore_{c}_total" for c in COUNTERS]
        return {
            n: {short(k): int(now[n].get(k, 0) - self.before[n].get(k, 0)) for k in names}
            for n in self.servers
        }


def short(metric: str) -> str:
    return "computed" if metric == COMPUTED else metric[len("vllm:kvstore_") : -len("_total")]


class Bench(ModelBench):
    def __init__(self, args, work: Path) -> None:
        super().__init__("pd", args, work)
        self.store: Served | None = None
        self.router: Router | None = None

    def start(self) -> dict:
        """The store, then every server and the router at once (the router opens its port
        once its workers answer /health)."""
        args, t0 = self.args, time.monotonic()
        n = args.length + TAIL
        chunks = 8 + (3 * args.requests + 2 * args.bursts * args.burst) * (n // CHUNK_TOKENS)
        self.store = Served(
            [KVSTORE, "serve", "--config", str(store_yaml(self.work / "store.yaml", chunks))]
        )

        def server(name: str, **extra) -> OpenAIServer:
            kv = connector(self.store.address, "raw")
            kv["kv_connector_extra_config"].update(extra)
            kv["kv_load_failure_policy"] = "recompute"
            return OpenAIServer(
                name,
                self.model,
                free_port(),
                self.logs,
                kv_transfer_config=kv,
                prefix_caching=False,  # every hit is the store's
                max_model_len=n + MAX_TOKENS + 64,
                server_args=["--dtype", "float32", "--block-size", "32", "--enforce-eager"],
                env=CPU_ENV,
            )

        self.servers["p"] = server("p")
        self.servers["d"] = server("d")
        self.servers["colocated"] = server("colocated", namespace_salt="colocated")
        for i in range(3, args.burst + 1):
            self.servers[f"on{i}"] = server(f"on{i}")
        for i in range(1, args.burst + 1):
            self.servers[f"off{i}"] = server(f"off{i}", single_flight=False, namespace_salt="off")
        url = "http://127.0.0.1:{}".format
        self.router = Router(
            [url(self.servers["p"].port)],
            [url(self.servers["d"].port)],
            free_port(),
            self.logs,
            prometheus_port=free_port(),
        )
        for s in self.servers.values():
            s.wait_ready()
        self.router.wait_ready()
        return {"all_ready_s": round(time.monotonic() - t0, 1), "servers": len(self.servers)}

    def prompt(self) -> list[int]:
        return self.tokens(self.args.length + TAIL)

    def pd_vs_colocated(self, progress: Progress) -> list[dict]:
        """Each new prompt through the router, then on the colocated server (or the other
        way round, alternately, so neither always runs first)."""
        rows = []
        for i in range(self.args.requests):
            prompt = self.prompt()
            watched = {n: self.servers[n] for n in ("p", "d", "colocated")}
            counted = Counted(watched)
            order = ("pd", "colocated") if i % 2 == 0 else ("colocated", "pd")
            ttft, text = {}, {}
            for which in order:
                port = self.router.port if which == "pd" else self.servers["colocated"].port
                ttft[which], text[which] = stream(port, prompt)
            n = len(prompt)
            got = counted.gained({"p": n, "d": n, "colocated": n})
            rows.append(
                {
                    "prompt_tokens": n,
                    "ttft_pd_s": round(ttft["pd"], 4),
                    "ttft_colocated_s": round(ttft["colocated"], 4),
                    "computed_prefill": got["p"]["computed"],
                    "computed_decode": got["d"]["computed"],
                    "loaded_decode": got["d"]["loaded_tokens"],
                    "computed_colocated": got["colocated"]["computed"],
                    "decode_waits": got["d"]["waits"],
                    "same_text": text["pd"] == text["colocated"],
                }
            )
            progress.step(f"P/D {i + 1}")
        return rows

    def burst(self, names: list[str]) -> dict:
        """One new prompt to every server in ``names`` at once."""
        prompt = self.prompt()
        group = {n: self.servers[n] for n in names}
        counted = Counted(group)
        start = threading.Barrier(len(names))

        def send(name: str) -> tuple[float, str]:
            start.wait()
            return stream(group[name].port, prompt)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(send, names))
        wall = time.perf_counter() - t0
        got = counted.gained({n: len(prompt) for n in names})
        return {
            "prompt_tokens": len(prompt),
            "computed_total": sum(g["computed"] for g in got.values()),
            "wall_s": round(wall, 3),
            "ttft_s": [round(a[0], 4) for a in answers],
            "same_text": len({a[1] for a in answers}) == 1,
            "per_server": got,
        }

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in self.servers.values():
            s.stop()
        if self.store is not None:
            self.store.stop()


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=None, help="prompt tokens (plus a 16 tail)")
    p.add_argument("--requests", type=int, default=None, help="P/D vs colocated prompts")
    p.add_argument("--burst", type=int, default=None, help="servers per single-flight burst")
    p.add_argument("--bursts", type=int, default=None, help="bursts with and without")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="built here when missing")
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    args.length = args.length or (2048 if args.quick else 4096)
    args.requests = args.requests or (3 if args.quick else 5)
    args.burst = args.burst or (2 if args.quick else 3)
    args.bursts = args.bursts or (1 if args.quick else 3)
    if args.length % CHUNK_TOKENS:
        p.error(f"--length must be a multiple of the chunk size {CHUNK_TOKENS}")
    if args.burst < 2:
        p.error("--burst must be at least 2")

    started = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="pd-") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            ready = bench.start()
            print(f"{ready['servers']} servers and the router ready in {ready['all_ready_s']} s")
            progress = Progress(args.requests + 2 * args.bursts, "pd")
            rows = bench.pd_vs_colocated(progress)
            on_names = ["p", "d"] + [f"on{i}" for i in range(3, args.burst + 1)]
            off_names = [f"off{i}" for i in range(1, args.burst + 1)]
            bursts = {"on": [], "off": []}
            for i in range(args.bursts):
                bursts["on"].append(bench.burst(on_names))
                progress.step(f"burst on {i + 1}")
                bursts["off"].append(bench.burst(off_names))
                progress.step(f"burst off {i + 1}")
            progress.done()
        finally:
            bench.stop()

    pd = {
        "ttft_pd_s": median([r["ttft_pd_s"] for r in rows]),
        "ttft_colocated_s": median([r["ttft_colocated_s"] for r in rows]),
        "computed_prefill_per_request": median([r["computed_prefill"] for r in rows]),
        "computed_decode_per_request": median([r["computed_decode"] for r in rows]),
        "loaded_decode_per_request": median([r["loaded_decode"] for r in rows]),
        "computed_colocated_per_request": median([r["computed_colocated"] for r in rows]),
        "all_same_text": all(r["same_text"] for r in rows),
    }
    pd["ttft_ratio"] = round(pd["ttft_pd_s"] / pd["ttft_colocated_s"], 3)
    on = sum(b["computed_total"] for b in bursts["on"])
    off = sum(b["computed_total"] for b in bursts["off"])
    single_flight = {
        "servers": args.burst,
        "computed_with": on,
        "computed_without": off,
        "ratio": round(on / off, 3) if off else None,
        "goal_ratio": round(1 / args.burst, 3),
        "wall_with_s": median([b["wall_s"] for b in bursts["on"]]),
        "wall_without_s": median([b["wall_s"] for b in bursts["off"]]),
        "all_same_text": all(b["same_text"] for g in bursts.values() for b in g),
    }
    print(
        f"P/D: TTFT through the router {pd['ttft_pd_s'] * 1e3:.0f} ms vs colocated "
        f"{pd['ttft_colocated_s'] * 1e3:.0f} ms ({pd['ttft_ratio']}x); per request the "
        f"prefill server computed {pd['computed_prefill_per_request']:.0f} tokens, the decode "
        f"server {pd['computed_decode_per_request']:.0f} (loaded "
        f"{pd['loaded_decode_per_request']:.0f}), colocated "
        f"{pd['computed_colocated_per_request']:.0f}"
    )
    print(
        f"single-flight, {args.burst} servers: {on} prompt tokens computed with, {off} without "
        f"(ratio {single_flight['ratio']}, goal ~{single_flight['goal_ratio']})"
    )
    emit(
        "pd",
        {
            "command": " ".join(["benchmarks/pd.py", *sys.argv[1:]]),
            "quick": args.quick,
            "length": args.length,
            "chunk_tokens": CHUNK_TOKENS,
            "pd": pd,
            "single_flight": single_flight,
            "requests": rows,
            "bursts": bursts,
            "elapsed_s": round(time.monotonic() - started, 1),
            # other work on the host slows prefills past wait_timeout_s: say how busy it was
            "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
