"""Helpers every benchmark shares: argument parsing, timing, JSON output."""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from collections.abc import Callable

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
