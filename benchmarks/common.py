"""Helpers every benchmark shares: argument parsing, timing, JSON output, real chunk sizes."""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from collections.abc import Callable

import numpy as np

from kvstore.core.keys import Namespace, chunk_keys
from kvstore.core.payload import HEADER_BYTES, ChunkHeader, build_payload, expected_body_len
from kvstore.core.types import ChunkRecord

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small run, under a minute")
    p.add_argument("--out", type=pathlib.Path, default=None, help="JSON output path")
    return p


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """Best (largest) of several throughput measurements: noise only ever slows a run."""
    return max(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def emit(name: str, result: dict, out: pathlib.Path | None) -> None:
    """Write the JSON file and print it as the last line."""
    result = {"benchmark": name, "machine": machine(), **result}
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def machine() -> dict:
    import os

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}


class Progress:
    """A one-line progress bar on stderr: done/total, elapsed, the current step's label."""

    def __init__(self, total: int, name: str, width: int = 30) -> None:
        self.total, self.name, self.width, self.done_n = total, name, width, 0
        self.t0 = time.monotonic()
        self.stream = sys.stderr
        self.tty = self.stream.isatty()  # elsewhere (logs, CI): a line per tenth
        self._draw("")

    def _draw(self, label: str) -> None:
        if not self.tty and self.done_n * 10 // max(1, self.total) == (
            (self.done_n - 1) * 10 // max(1, self.total)
        ):
            return
        filled = self.width * self.done_n // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.t0
        line = f"{self.name} [{bar}] {self.done_n}/{self.total} {elapsed:5.0f}s {label:<32.32}"
        self.stream.write("\r" + line if self.tty else line.rstrip() + "\n")
        self.stream.flush()

    def step(self, label: str = "") -> None:
        self.done_n += 1
        self._draw(label)

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- real chunk geometries ------------------------------------------------------------

# Llama-3-8B's KV: 32 layers x 8 KV heads x head_dim 128; the README's connector config
# cuts it into 256-token chunks: (layers, kv_heads, tokens, head_dim).
LLAMA8B_CHUNK = (32, 8, 256, 128)


def chunk_len(codec: str, src_dtype: str, shape: tuple[int, int, int, int]) -> int:
    """Payload bytes (header + body) of one chunk: 17,170,468 for Llama-3-8B fp8."""
    return HEADER_BYTES + expected_body_len(codec, src_dtype, shape)


def chunk_payload(codec: str, src_dtype: str, shape: tuple[int, int, int, int], body) -> bytearray:
    """A valid payload (header, checksum) whose body is the first bytes of ``body``."""
    n = expected_body_len(codec, src_dtype, shape)
    return build_payload(ChunkHeader(codec, src_dtype, *shape, n), memoryview(body)[:n])


def chain(ns: Namespace, payloads: list, seed: int) -> list[ChunkRecord]:
    """Chained records over ``payloads`` for a prompt whose tokens derive from ``seed``."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, len(payloads) * ns.chunk_tokens)
    digest = ns.digest()
    keys = chunk_keys(digest, tokens, ns.chunk_tokens)
    return [
        ChunkRecord(k, keys[i - 1] if i else None, digest, p)
        for i, (k, p) in enumerate(zip(keys, payloads, strict=True))
    ]
