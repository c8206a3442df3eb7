"""What ``tests.procs`` promises the fixtures that start real processes: a start that
fails after a ``kvstore serve`` started leaves no store running (``stopped_on_failure``,
as the module fixtures that start a store and then vLLM engines use it), a teardown
whose first stop fails still stops the rest (``stop_all``), and a server that never
prints its banner, or does not stop when asked, is not left running either (``Served``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import KVSTORE, Served, stop_all, stopped_on_failure, store_config


def running(pid: int) -> bool:
    """Whether ``pid`` lives (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(pid: int) -> list[int]:
    """``pid``'s descendants now, from ``/proc`` (one that exits meanwhile is left out)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split()]
        except FileNotFoundError:
            continue
    return found + [g for c in found if running(c) for g in children_of(c)]


def put_process_started(store: Served, timeout: float = 30) -> list[int]:
    """The store's child processes, once its put process (started after the banner) runs."""
    deadline = time.monotonic() + timeout
    while not (children := children_of(store.proc.pid)):
        assert time.monotonic() < deadline, "the store's put process never started"
        time.sleep(0.05)
    return children


def test_a_start_that_fails_after_the_store_started_stops_the_store_and_its_put_process(
    tmp_path,
):
    cfg = store_config(tmp_path / "kv.yaml", tmp_path / "lmdb")  # with a put process
    started: list[Served] = []
    try:
        with pytest.raises(AssertionError, match="no banner"), stopped_on_failure() as stops:
            store = Served([KVSTORE, "serve", "--config", str(cfg)])
            started.append(store)
            stops.append(store.stop)
            children = put_process_started(store)
            # the next start fails, as an engine or server that never comes up does
            Served([sys.executable, "-c", "print('starting')"])
        alive = [p for p in [store.proc.pid, *children] if running(p)]
        assert not alive, f"left running after the failed start: {alive}"
        assert store.proc.returncode == 0  # stopped (SIGTERM, its region removed), not killed
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.stop()


def test_a_server_that_never_gives_its_banner_is_not_left_running(tmp_path):
    pid_file = tmp_path / "pid"
    script = (
        "import os, time; "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print('starting', flush=True); os.close(1); os.close(2); time.sleep(600)"
    )
    with pytest.raises(AssertionError, match="no banner"):
        Served([sys.executable, "-c", script])
    pid = int(pid_file.read_text())
    try:
        assert not running(pid), "the server without a banner was left running"
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_teardown_whose_first_stop_fails_still_stops_the_store(tmp_path):
    store = Served(
        [KVSTORE, "serve", "--config", str(store_config(tmp_path / "kv.yaml", tmp_path / "db"))]
    )
    children = put_process_started(store)

    def router_stop() -> None:
        raise RuntimeError("the router would not stop")

    try:
        with pytest.raises(RuntimeError, match="the router would not stop"):
            stop_all([router_stop, store.stop])
        alive = [p for p in [store.proc.pid, *children] if running(p)]
        assert not alive, f"left running after the failed stop: {alive}"
        assert store.proc.returncode == 0
    finally:
        if store.proc.poll() is None:
            store.stop()


def test_a_server_that_ignores_sigterm_is_killed_by_its_stop():
    banner = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('listening on 127.0.0.1:1', flush=True); "
        "print('metrics: http://127.0.0.1:2/metrics', flush=True); time.sleep(600)"
    )
    server = Served([sys.executable, "-c", banner])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            server.stop(timeout_s=1)
        assert server.proc.returncode == -signal.SIGKILL
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
