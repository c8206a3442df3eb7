"""Shared-memory regions under ``/dev/shm`` that a crashed store never leaks for long.

Offers ``ShmRegion(nbytes)`` (create, map read-write, ``close()`` unmaps and
unlinks) and ``reclaim_stale()`` (unlink the regions of stores that died).

A live store holds an exclusive ``flock`` on its region file for as long as it
runs; the kernel drops the lock when the process dies, however it dies. So a
region whose lock can be taken has no owner: a store killed with SIGKILL leaves
its region (prefaulted, so it holds RAM) behind, and the next store to start
on the host removes it. Readers map regions without locking them. A file is
locked before it is given its size, so an empty file is one being created.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import mmap
import os
import secrets
import time

from kvstore.core.types import InvalidArgument

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
PREFIX = "kvstore-"
_EMPTY_GRACE_S = 60.0  # an empty region older than this was never finished


def reclaim_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every kvstore region no live process holds; returns their names."""
    reclaimed = []
    for path in glob.glob(os.path.join(shm_dir, PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live store holds it
            st = os.fstat(fd)
            if st.st_size == 0 and time.time() - st.st_mtime < _EMPTY_GRACE_S:
                continue  # another store is creating it right now
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            reclaimed.append(os.path.basename(path))
        finally:
            os.close(fd)
    if reclaimed:
        log.warning(
            "removed %d shared-memory region(s) left by stores that died: %s",
            len(reclaimed),
            ", ".join(reclaimed),
        )
    return reclaimed


class ShmRegion:
    """A new region of ``nbytes``, created mode 0600 and locked by this process."""

    def __init__(self, nbytes: int, name: str | None = None, shm_dir: str = SHM_DIR) -> None:
        _check_room(nbytes, shm_dir)
        self.name = name or f"{PREFIX}{secrets.token_hex(6)}"
        self.path = os.path.join(shm_dir, self.name)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as e:
            raise InvalidArgument(
                f"shared-memory region {self.name!r} already exists and is in use"
            ) from e
        self._fd: int | None = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, nbytes)
            self.mmap: mmap.mmap | None = mmap.mmap(fd, nbytes)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unlink the file, unmap the region and drop the lock. Idempotent.

        A region with live views (``BufferError``) stays mapped until the last
        view goes; its file is unlinked all the same.
        """
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self.mmap is not None:
            with contextlib.suppress(BufferError):
                self.mmap.close()
            self.mmap = None
        os.close(self._fd)
        self._fd = None


def _check_room(nbytes: int, shm_dir: str) -> None:
    # Touching pages past the tmpfs limit kills the process with SIGBUS; fail clearly instead.
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise InvalidArgument(
            f"dram tier needs {nbytes} B of shared memory but {shm_dir} has {free} B free; "
            "lower dram capacity or enlarge /dev/shm (docker: --shm-size)"
        )
