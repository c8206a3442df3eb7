"""The client's side of same-host reads: copies out of the store's shared memory,
checked before they are trusted.

Offers ``ShmReader`` (``copy_out(keys, handles, copy)`` returns the indices whose
copy cannot be trusted; ``close()``), ``ShmReadStats``, its counts of why a
chunk was not taken from shared memory, and ``copiers(dests)``, which copy into a
caller's buffers or CPU tensors.

A handle names a region under ``/dev/shm``, an offset and a length; the store
writes each chunk's 16-byte key just before its payload. A copy is kept only if,
once it is made, that key is the one asked for and the payload header claims the
handle's length; the caller also drops every copy whose lease the store no
longer held at release (``lease_lapsed``), since its bytes may have been reused
meanwhile. Whatever is dropped is read again over TCP.

A store has one region, so a handle naming a region not mapped here means the
store restarted: the old mappings are closed then, rather than holding a dead
store's memory for as long as the client lives. A region that cannot be mapped
(gone, not ours to read) makes its chunks come over TCP instead. Never writes to the
store's memory (the mapping is private) and never hands back a copy it has not checked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.client.prefault import populate_in_background
from kvstore.core import bulk_copy
from kvstore.core.lanes import spread
from kvstore.core.payload import parse_header
from kvstore.core.types import KEY_BYTES, PayloadError
from kvstore.rpc.pb import pb

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"


@dataclass(slots=True)
class ShmReadStats:
    """Chunks taken from shared memory, the ones read over TCP instead, and why.

    A dropped chunk counts under every reason that applied to it.
    """

    chunks: int = 0  # copies kept
    dropped: int = 0  # handles whose bytes were read again over TCP
    lease_lapsed: int = 0  # the lease had ended by release: the slot may have been reused
    key_mismatch: int = 0  # the key before the payload was another chunk's
    bad_length: int = 0  # the payload header disagrees with the handle's length
    region_unavailable: int = 0  # the region could not be mapped
    regions_mapped: int = 0  # a region mapped here, the first and each after a restart
    grants_used: int = 0  # reads done under a leased lookup's handles (no GetShm)
    grants_unused: int = 0  # a leased lookup's handles passed over: stale, short or unusable

    def count(self, handles: int, good: int, held: bool) -> int:
        """Count a leased batch of ``handles`` of which ``good`` held their chunk; none
        is kept unless the lease ``held``. Returns how many are kept."""
        if not held:
            self.lease_lapsed += handles
            good = 0
        self.chunks += good
        self.dropped += handles - good
        return good


def copiers(dests: Sequence) -> list[Callable[[memoryview], None]]:
    """``copy(src)`` into each of ``dests``: writable buffers or contiguous CPU torch
    tensors.

    A large batch is copied with streaming stores (``bulk_copy``). Otherwise tensors are
    filled with torch's own copy, which splits large copies across threads; other
    buffers, and read-only sources (bytes received over TCP, which torch will not wrap
    without a warning), with numpy. None makes a temporary.
    """
    flats = [_flat(d) for d in dests]
    stream = bulk_copy.streamer(sum(f.nbytes for f, _ in flats))
    return [_copier(flat, tensor, stream) for flat, tensor in flats]


def _flat(dest) -> tuple[np.ndarray, object]:
    """``dest``'s bytes as a numpy array, and its flat uint8 tensor if it is a tensor."""
    if hasattr(dest, "untyped_storage"):  # a torch tensor has no buffer protocol
        import torch

        # view, not reshape: a non-contiguous tensor must fail, not be copied into a temporary
        flat = dest.view(-1).view(torch.uint8)
        return flat.numpy(), flat
    return np.frombuffer(dest, dtype=np.uint8), None


def _copier(flat_np: np.ndarray, tensor, stream) -> Callable[[memoryview], None]:
    if stream is not None:
        return lambda src: stream(flat_np[: src.nbytes], np.frombuffer(src, dtype=np.uint8))
    if tensor is not None:
        import torch

        def copy(src: memoryview) -> None:
            if src.readonly:
                np.copyto(flat_np[: src.nbytes], np.frombuffer(src, dtype=np.uint8))
            else:
                tensor[: src.nbytes].copy_(torch.frombuffer(src, dtype=torch.uint8))

        return copy
    return lambda src: np.copyto(flat_np[: src.nbytes], np.frombuffer(src, dtype=np.uint8))


class _RegionUnavailable(Exception):
    pass


class ShmReader:
    """Maps the region the store names, one at a time.

    The mapping is private: the store's writes show through, and since nothing
    is ever written here no page is copied, but the views are writable, which
    lets torch wrap them without a copy or a warning, and a stray write could
    never reach the store.
    """

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.stats = ShmReadStats()
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        # the page tables of the mapped region are filled in the background
        self.prefault: threading.Thread | None = None

    def copy_out(
        self,
        keys: Sequence[bytes],
        handles: Sequence[pb.ShmHandle],
        copy: Callable[[int, memoryview], None],
    ) -> set[int]:
        """``copy(i, view)`` each handle's bytes; the indices whose copy must not be kept.

        The copies of a large batch run on several threads (``lanes.spread``), so
        ``copy`` must be safe to call from any thread for distinct ``i``."""
        if not handles:
            return set()
        try:
            region = self._region(handles[0].region)
            if any(h.region != handles[0].region for h in handles):
                raise _RegionUnavailable("one batch names two regions")
        except _RegionUnavailable as exc:
            log.warning(
                "shared memory unusable, reading %d chunk(s) over TCP: %s", len(handles), exc
            )
            self.stats.region_unavailable += len(handles)
            return set(range(len(handles)))
        bad = set()
        views: list[tuple[int, memoryview]] = []
        for i, handle in enumerate(handles):
            end = handle.offset + handle.length
            if handle.offset < KEY_BYTES or end > len(region):
                self.stats.bad_length += 1
                bad.add(i)
                continue
            views.append((i, region[handle.offset : end]))
        spread([functools.partial(copy, i, v) for i, v in views], [v.nbytes for _, v in views])
        for i, view in views:
            handle = handles[i]
            # checked after the copy: a slot reused before or during it shows another key
            if bytes(region[handle.offset - KEY_BYTES : handle.offset]) != keys[i]:
                self.stats.key_mismatch += 1
                bad.add(i)
                continue
            try:
                parse_header(view)
            except PayloadError:
                self.stats.bad_length += 1
                bad.add(i)
        return bad

    def views(
        self, keys: Sequence[bytes], handles: Sequence[pb.ShmHandle]
    ) -> tuple[memoryview, list[memoryview]] | None:
        """The region and a view of each handle's payload in it, nothing copied; None
        unless every handle is in one mapped region and holds its key and a payload
        header claiming its length now. The caller reads the views under the lease and
        then asks ``unchanged`` (and whether the lease held) before trusting what it read.
        """
        if not handles:
            return None
        try:
            region = self._region(handles[0].region)
        except _RegionUnavailable as exc:
            log.warning("shared memory unusable, reading over TCP: %s", exc)
            self.stats.region_unavailable += len(handles)
            return None
        views = []
        for key, handle in zip(keys, handles, strict=False):
            end = handle.offset + handle.length
            if handle.region != handles[0].region or handle.offset < KEY_BYTES:
                return None
            if end > len(region) or not self._holds(region, handle, key):
                return None
            views.append(region[handle.offset : end])
        return region, views

    def unchanged(
        self, region: memoryview, keys: Sequence[bytes], handles: Sequence[pb.ShmHandle]
    ) -> int:
        """How many leading handles still hold their key: asked after the bytes were used
        (a slot reused meanwhile shows another key)."""
        for i, (key, handle) in enumerate(zip(keys, handles, strict=False)):
            if not self._holds(region, handle, key):
                self.stats.key_mismatch += 1
                return i
        return len(handles)

    @staticmethod
    def _holds(region: memoryview, handle: pb.ShmHandle, key: bytes) -> bool:
        if bytes(region[handle.offset - KEY_BYTES : handle.offset]) != key:
            return False
        try:
            parse_header(region[handle.offset : handle.offset + handle.length])
        except PayloadError:
            return False
        return True

    def _region(self, name: str) -> memoryview:
        """A view of the whole region: while it lives, closing the mapping cannot unmap it."""
        with self._lock:
            region = self._maps.get(name)
            if region is not None:
                return memoryview(region)
            # a store has one region: another name means it restarted, so the old one is dead
            self._close_maps()
            if not name or os.path.basename(name) != name or name.startswith("."):
                raise _RegionUnavailable(f"the store named the region {name!r}")
            path = os.path.join(self.shm_dir, name)
            try:
                with open(path, "rb") as f:
                    region = mmap.mmap(
                        f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                    )
            except (OSError, ValueError) as exc:  # ValueError: an empty file, still being made
                raise _RegionUnavailable(f"cannot map {path}: {exc}") from exc
            self._maps[name] = region
            self.stats.regions_mapped += 1
            self.prefault = populate_in_background(region)
            return memoryview(region)

    def mapped(self) -> list[str]:
        """Names of the regions mapped now."""
        with self._lock:
            return list(self._maps)

    def _close_maps(self) -> None:
        for region in self._maps.values():
            # a caller may still hold a view: the region is unmapped when the last one goes
            with contextlib.suppress(BufferError):
                region.close()
        self._maps.clear()

    def close(self) -> None:
        with self._lock:
            self._close_maps()
