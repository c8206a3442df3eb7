"""``tests.shm_regions.orphan_semaphores``, which the session uses to remove what vLLM
servers killed on purpose leave in /dev/shm: a semaphore is an orphan once no live
process maps it, and never while one does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.shm_regions import SHM_DIR, orphan_semaphores

# a process that makes a named semaphore (the spawn context keeps its name until its
# resource tracker unlinks it), prints the name and waits to be killed
HOLDER = """
import multiprocessing as mp, sys, time
lock = mp.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(600)
"""


def start_holder() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    name = "sem." + proc.stdout.readline().strip().lstrip("/")
    assert os.path.exists(os.path.join(SHM_DIR, name)), name
    return proc, name


def test_a_semaphore_is_an_orphan_once_its_holders_are_killed_and_not_before():
    since = time.time() - 1
    killed, orphan = start_holder()
    alive, held = start_holder()
    try:
        os.killpg(killed.pid, signal.SIGKILL)  # its resource tracker too: nothing unlinks it
        killed.wait(timeout=30)
        deadline = time.monotonic() + 10
        while orphan not in orphan_semaphores(since) and time.monotonic() < deadline:
            time.sleep(0.05)  # the tracker may take a moment to die
        found = orphan_semaphores(since)
        assert orphan in found
        assert held not in found  # a live process maps it
        assert orphan not in orphan_semaphores(time.time() + 60)  # made before "since"
    finally:
        os.killpg(alive.pid, signal.SIGKILL)
        alive.wait(timeout=30)
        for name in (orphan, held):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
