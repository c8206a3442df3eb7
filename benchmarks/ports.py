"""Whose listener answers on a loopback port.

A test or benchmark picks a free port, then hands it to a server that binds it seconds
later. vLLM's API server binds with ``SO_REUSEADDR`` long before it listens (it builds its
engine in between), and two sockets with ``SO_REUSEADDR`` may both bind one port while
neither listens: two servers handed the same port both start, the first to listen takes
every request, and the other exits later. ``/health`` answers 200 either way, so a
server's readiness check asks who listens too.

Offers ``listener_inodes(port)`` and ``listens_in(pid, port)`` (Linux ``/proc``; None where
it cannot tell).
"""

from __future__ import annotations

import os

LISTEN = "0A"  # the TCP state column of /proc/net/tcp


def listener_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on TCP ``port`` (any address), or None without /proc."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes if readable else None


def listens_in(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on ``port``; None where this
    cannot be told (no /proc, or the process's descriptors cannot be read)."""
    inodes = listener_inodes(port)
    if inodes is None:
        return None
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False
