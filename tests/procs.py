"""Real processes for tests and benchmarks: a `kvstore serve` store and its banner, a free
loopback port, the connector's vLLM config, waiting for asynchronous saves to land,
``stopped_on_failure`` for a fixture that starts several things in turn, and ``stop_all``
for its teardown."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVSTORE = str(Path(sys.executable).parent / "kvstore")


def store_config(path: Path, lmdb: Path, dram: str = "64MiB", put_process: bool = True) -> Path:
    """A store's YAML config; without ``put_process``, every put goes to the store's own
    port (where a test's proxy in front of that port must see all of a client's traffic)."""
    path.write_text(
        "\n".join(
            [
                "server:",
                "  listen: 127.0.0.1:0",
                "  metrics_listen: 127.0.0.1:0",
                "  grace_s: 5",
                f"  put_process: {str(put_process).lower()}",
                "dram:",
                f"  capacity_bytes: {dram}",
                "nvme:",
                f"  path: {lmdb}",
                "  map_size: 512MiB",
            ]
        )
        + "\n"
    )
    return path


class Served:
    """A server subprocess; ``address`` and ``metrics_port`` come from its banner."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        banner = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            banner.append(line)
            if "metrics:" in line:
                break
        text = "".join(banner)
        m = re.search(r"listening on (\S+)", text)
        if not m:  # a server that never said where it listens is not left running
            self.proc.terminate()
            try:
                _, err = self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate()
            raise AssertionError(f"no banner; stdout={text!r} stderr={err!r}")
        self.address = m.group(1)
        port = re.search(r"metrics: http://[^:]+:(\d+)/metrics", text)
        self.metrics_port = int(port.group(1)) if port else None

    def stop(self, timeout_s: float = 30) -> tuple[int, str]:
        """SIGTERM, then ``(exit code, stderr)``; a server not gone ``timeout_s`` later is
        killed and the timeout raised, so no failed stop leaves it running."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        return self.proc.returncode, err

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


@contextlib.contextmanager
def stopped_on_failure() -> Iterator[list[Callable[[], object]]]:
    """For a fixture that starts several things in turn (a store, then engines): after
    each start, ``stops.append(<what stops it>)``. If a later start raises, everything
    appended is stopped, last first, and the start's error goes on (a stop that fails
    too is noted on it). Once all have started nothing is stopped here: that is the
    fixture's teardown, after its ``yield``."""
    stops: list[Callable[[], object]] = []
    try:
        yield stops
    except BaseException as exc:
        for err in _call_each(reversed(stops)):  # the failed start is what the run reports
            exc.add_note(f"stopping what had started failed too: {err!r}")
        raise


def stop_all(stops: Iterable[Callable[[], object]]) -> None:
    """A teardown's stops, each called even when one before it raised, so that one failed
    stop leaves nothing else running; then the first failure is raised, the others noted
    on it."""
    errors = _call_each(stops)
    if errors:
        for err in errors[1:]:
            errors[0].add_note(f"another stop failed too: {err!r}")
        raise errors[0]


def _call_each(calls: Iterable[Callable[[], object]]) -> list[Exception]:
    errors = []
    for call in calls:
        try:
            call()
        except Exception as err:
            errors.append(err)
    return errors


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never handed out before by this process: the server
    it is for binds it only later, and two servers given one port could both start (see
    ``benchmarks.ports``)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def kv_transfer_config(store: str, codec: str, chunk_tokens: int, **extra) -> dict:
    """vLLM's ``kv_transfer_config`` for the kvstore connector.

    The load planner is off unless asked for: tests and benchmarks measure loading, and a
    tiny model's prefill is cheap enough that the planner would compute their hits instead.
    """
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": store,
            "codec": codec,
            "chunk_tokens": chunk_tokens,
            "planner": False,
            **extra,
        },
    }


def store_hits(address: str) -> int:
    """Chunk reads the store served, all tiers together."""
    from kvstore.client import KVStoreClient

    with KVStoreClient(address) as client:
        return sum(t.hits for t in client.stats().tiers)


def wait_for_chunks(address: str, n: int, timeout: float = 60) -> int:
    """Saves are asynchronous: wait until the store holds ``n`` chunks; returns its count."""
    from kvstore.client import KVStoreClient

    deadline = time.monotonic() + timeout
    with KVStoreClient(address) as client:
        while True:
            chunks = client.stats().chunks
            if chunks >= n or time.monotonic() > deadline:
                return chunks
            time.sleep(0.05)
