"""Where the store's shared-memory regions live, how they are named, and mapping one.

Offers ``SHM_DIR``, ``PREFIX`` and ``map_region(name)``: an existing region, mapped shared
and writable (same host, same user). The store creates its regions
(``kvstore.server.tiers.shm_region``); same-host writers and the store's put process map
them by the name the store hands out, checked first, so that no other file is ever
opened.
"""

from __future__ import annotations

import mmap
import os

SHM_DIR = "/dev/shm"
PREFIX = "kvstore-"


def map_region(name: str) -> mmap.mmap:
    """The region ``name``, mapped shared and writable; ``OSError`` if it is not one."""
    if "/" in name or not name.startswith(PREFIX):
        raise OSError(f"not a kvstore region: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
