"""Helpers every benchmark shares: argument parsing, timing, JSON output."""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
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
