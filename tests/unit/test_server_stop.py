"""``benchmarks.openai_server.stop_group``, which stops a vLLM server's process group: the
server's multiprocessing semaphores (``/dev/shm/sem.mp-*``) do not outlive it. The
stand-in server is a real process that holds one, as vLLM's servers do: a named
semaphore that multiprocessing's resource tracker (a process of the same group, which
ignores SIGTERM) unlinks once its holder is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.openai_server import stop_group
from tests.shm_regions import SHM_DIR

HOLDER = """
import multiprocessing, os, signal
lock = multiprocessing.get_context("spawn").Semaphore()  # /dev/shm/sem.mp-*, tracked
print(os.getpid(), flush=True)
signal.pause()
"""


def semaphores() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("sem.mp-")}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stopped_server_group_leaves_no_semaphore_and_no_process():
    before = semaphores()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, start_new_session=True
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline()  # its semaphore exists now
        assert len(semaphores() - before) == 2
        for p in procs:
            stop_group(p, grace_s=10)
            assert p.returncode is not None
            deadline = time.monotonic() + 5  # a SIGKILLed member may take a moment to go
            while group_alive(p.pid):
                assert time.monotonic() < deadline, "the server's group outlived its stop"
                time.sleep(0.02)
        assert semaphores() - before == set()
    finally:
        for p in procs:
            if group_alive(p.pid):
                os.killpg(p.pid, 9)
            p.stdout.close()
        for name in semaphores() - before:  # what a failed run left
            os.unlink(os.path.join(SHM_DIR, name))
