"""Copies of large byte buffers that write their destination with streaming stores.

Offers ``copier(total)``: the function ``copy(dest, src)`` (numpy uint8 arrays of one
size) to use for a batch of copies of ``total`` bytes; ``streamer(total)``, the same but
None where the batch would not be streamed (the caller keeps its own copy);
``uncached_copier()``, for bytes nobody reads soon (a store's copy into its memory),
streamed whatever their size; ``load()``.

Batches of at least ``STREAM_MIN`` bytes, more than a reader would find in the cache
afterwards anyway, go through ``stream_copy.c`` (1.6-1.8x memcpy on the project's hosts,
see there); smaller ones, and every copy where the C source cannot be built (no
compiler: logged once, at INFO) or the CPU has no streaming stores, through ``np.copyto``. Both
let the GIL go while they copy, so callers spread large batches over cores with
``lanes.spread``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.core import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("stream_copy.c")
FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared"]
# 64 MiB in 1 MiB pieces: 1.7x memcpy; 16 MiB: 1.15-2x; 4 MiB: no gain (the copy's
# destination would mostly have stayed in a 32 MiB cache for whoever reads it next)
STREAM_MIN = 8 << 20

Copy = Callable[[np.ndarray, np.ndarray], None]

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> ctypes.CDLL | None:
    """The streaming copy, built on first use; None where it cannot be built or would
    not stream (the reason logged once)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _open()
        return _state["lib"]  # type: ignore[return-value]


def _open() -> ctypes.CDLL | None:
    try:
        lib = native.build(SOURCE, FLAGS)
    except Exception as exc:  # plain copies then, ~1.5x slower on large ones: say why, once
        log.info("streaming copy unavailable, using memcpy: %s", exc)
        return None
    if not lib.kv_stream_copy_streams():
        return None  # no streaming stores on this CPU: it would be memcpy with extra steps
    lib.kv_stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.kv_stream_copy.restype = None
    return lib


def _plain(dest: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dest, src)


def copier(total: int) -> Copy:
    """How to copy a batch of ``total`` bytes: streamed where that pays and is built."""
    return streamer(total) or _plain


def uncached_copier() -> Copy:
    """How to copy bytes that nobody reads soon after: streamed whatever their size where
    that is built, since keeping them in the cache would only push others out."""
    return _streamed(load()) or _plain


def streamer(total: int) -> Copy | None:
    """The streamed copy for a batch of ``total`` bytes; None where it would not pay or
    is not built."""
    return _streamed(load()) if total >= STREAM_MIN else None


def _streamed(lib: ctypes.CDLL | None) -> Copy | None:
    if lib is None:
        return None
    stream = lib.kv_stream_copy

    def copy(dest: np.ndarray, src: np.ndarray) -> None:
        if dest.nbytes != src.nbytes or dest.dtype != np.uint8 or src.dtype != np.uint8:
            raise ValueError(
                f"copy of {src.nbytes} B ({src.dtype}) into {dest.nbytes} B ({dest.dtype})"
            )
        if not (dest.flags.c_contiguous and src.flags.c_contiguous and dest.flags.writeable):
            raise ValueError("streamed copies need contiguous buffers and a writable destination")
        stream(dest.ctypes.data, src.ctypes.data, src.nbytes)

    return copy
