"""Shared-memory regions in ``/dev/shm`` as tests see them: ``regions()`` names the
stores' regions, ``held(name)`` says whether a live process holds one (each store
flocks its own), ``owned_here()`` those this process has open, ``mapped_here()`` every
/dev/shm file this process maps, and ``left_behind(since)`` those nothing will remove.
``orphan_semaphores(since)`` names the multiprocessing semaphores no live process maps:
what a vLLM server's process group killed with SIGKILL leaves (its resource tracker dies
with it)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os

SHM_DIR = "/dev/shm"
PREFIX = "kvstore-"


def regions() -> set[str]:
    return {os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, PREFIX + "*"))}


def held(name: str) -> bool:
    """True while a live process holds the region's lock; False if free or gone."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def owned_here() -> set[str]:
    """Regions this process has open: a store it never closed leaves them at exit."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(os.path.join(SHM_DIR, PREFIX)):
                names.add(os.path.basename(target))
    return names


def mapped_here() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(SHM_DIR + "/", 1)[1].split()[0] for line in f if SHM_DIR + "/" in line}


def resident_kib(name: str) -> int:
    """Rss (KiB) of this process's mappings of region ``name``: the pages it has mapped."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                ours = fields[-1] == os.path.join(SHM_DIR, name)
            elif ours and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def left_behind(since: float) -> list[str]:
    """Regions made at or after ``since`` (epoch seconds) that nothing will remove: no
    live process holds them, or only this one, which will exit without closing them."""
    here = owned_here()
    out = []
    for name in sorted(regions()):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(os.path.join(SHM_DIR, name))
            if st.st_ctime < since or st.st_size == 0:  # older, or a store creating it now
                continue
            if name in here or not held(name):
                out.append(name)
    return out


def _inodes_mapped_anywhere() -> set[int]:
    """Inodes of /dev/shm files some live process maps. By inode, not name: glibc makes a
    named semaphore as a temporary file, maps it, then links it under its name and
    unlinks the temporary one, so the mapping carries the other name."""
    out: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:  # gone meanwhile
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith(SHM_DIR + "/"):
                    out.add(int(fields[4]))
    return out


def orphan_semaphores(since: float) -> list[str]:
    """``sem.mp-*`` made at or after ``since`` that no live process maps: nothing can
    open one by name again (its creator and every user are gone), and nothing will
    remove it."""
    made = {}
    for path in glob.glob(os.path.join(SHM_DIR, "sem.mp-*")):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            if st.st_ctime >= since:
                made[os.path.basename(path)] = st.st_ino
    if not made:
        return []
    mapped = _inodes_mapped_anywhere()
    return sorted(name for name, inode in made.items() if inode not in mapped)
