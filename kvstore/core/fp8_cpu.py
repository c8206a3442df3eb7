"""The fp8 codec's CPU kernels (``fp8_cpu.c``): built once per host with the C compiler
that ``torch.compile`` needs anyway, loaded with ctypes, bit for bit the eager kernels.

torch's inductor leaves e4m3 conversions scalar on CPU (1-2 GB/s here, against 7+ for
these loops vectorised by the compiler). ``load()`` returns None, and the codec keeps its
torch kernels, where no compiler is found or the build fails; the reason is logged once.
The same library places a load's chunks straight into a paged CPU cache's blocks
(``decode_blocks_calls`` for fp8, ``copy_blocks_calls`` for raw; see ``fp8_blocks``).

The shared object is built and cached by ``native.build`` (once per host, source and
compiler; ``$KVSTORE_CACHE_DIR``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.core import native
from kvstore.core.lanes import LANES, spread

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp8_cpu.c")
# -fno-trapping-math: no FP exception flags are read, and without it GCC keeps the
# conversions' selects scalar (decode 1.5 GB/s against 8 here); results are unchanged
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-trapping-math"]
SPLIT_BYTES = 2 << 20  # values this large are split between lanes
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_state: dict[str, object] = {}


def _open() -> ctypes.CDLL:
    lib = native.build(SOURCE, FLAGS)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.kv_fp8_encode.argtypes = [ptr, i32, ptr, ptr, i64, i64, i64, i32]
    lib.kv_fp8_decode.argtypes = [ptr, ptr, ptr, i32, i64, i64, i64, i32]
    lib.kv_fp8_decode_blocks.argtypes = [ptr, ptr, ptr, i32, ptr]
    lib.kv_copy_blocks.argtypes = [ptr, ptr, ptr, i64, ptr]
    return lib


def load() -> ctypes.CDLL | None:
    """The kernels, built on first use; None (logged once) where they cannot be built."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _open()
            except Exception as exc:  # the codec falls back to torch: say why, once
                log.warning("fp8 CPU kernels unavailable, using torch's: %s", exc)
                _state["lib"] = None
        return _state["lib"]  # type: ignore[return-value]


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go through the kernels: CPU, contiguous."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _slab(shape: torch.Size) -> tuple[int, int, int]:
    *outer, tokens, dim = shape
    count = 1
    for n in outer:
        count *= n
    return count, tokens, dim


Call = tuple[Callable[[], object], int]  # a kernel call over a range of rows, bytes of values


def _ranges(
    kernel: Callable[[list[int], int], None],
    tensors: tuple[torch.Tensor, ...],
    rows: tuple[int, ...],
    values_row: int,
    outer: int,
) -> list[Call]:
    """``kernel(pointers, count)`` over ``outer`` rows split into ranges, one per lane where
    the tensor is large (the pointers: ``tensors``' data, advanced by ``rows`` bytes per
    row). Each call holds the tensors, so that the addresses it carries stay theirs for
    as long as the call may run, whatever its maker keeps."""
    parts = min(LANES, outer) if outer * values_row >= SPLIT_BYTES else 1
    ptrs = [t.data_ptr() for t in tensors]
    calls: list[Call] = []
    for i in range(parts):
        lo, hi = outer * i // parts, outer * (i + 1) // parts
        at = [p + lo * size for p, size in zip(ptrs, rows, strict=True)]
        call = functools.partial(_held, kernel, at, hi - lo, tensors)
        calls.append((call, (hi - lo) * values_row))
    return calls


def _held(kernel: Callable[[list[int], int], None], at: list[int], count: int, _tensors) -> None:
    kernel(at, count)


def _check_sizes(values: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, per_token: bool):
    outer, tokens, dim = _slab(values.shape)
    want = outer * (tokens if per_token else dim)
    if codes.numel() != values.numel() or scale.numel() != want or scale.dtype != torch.float32:
        raise ValueError("fp8: codes or scales do not match the values' sizes")
    if values.dtype not in DTYPES:
        raise ValueError(f"fp8: unsupported dtype {values.dtype}")
    return outer, tokens, dim


def encode_calls(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, per_token: bool
) -> list[Call]:
    """The calls that quantise ``x`` ([..., tokens, dim], CPU, contiguous) into ``codes``
    (one byte each, x's shape) and ``scale`` (float32: [..., tokens] per token, [..., dim]
    per channel); ``run`` them."""
    outer, tokens, dim = _check_sizes(x, codes, scale, per_token)
    rows = (tokens * dim * x.element_size(), tokens * dim, 4 * (tokens if per_token else dim))
    lib, dtype = load(), DTYPES[x.dtype]

    def kernel(at: list[int], count: int) -> None:
        rc = lib.kv_fp8_encode(at[0], dtype, at[1], at[2], count, tokens, dim, per_token)
        if rc == -2:
            raise MemoryError(f"fp8 encode: no memory for {dim} channels' scratch")
        if rc != 0:
            raise ValueError(f"fp8 encode refused dtype {x.dtype}")

    return _ranges(kernel, (x, codes, scale), rows, rows[0], outer)


def decode_calls(
    codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, per_token: bool
) -> list[Call]:
    """The calls that dequantise ``codes`` with ``scale`` (as ``encode_calls`` lays them
    out) into ``out`` (float32, bfloat16 or float16, codes' shape, contiguous)."""
    outer, tokens, dim = _check_sizes(out, codes, scale, per_token)
    rows = (tokens * dim, 4 * (tokens if per_token else dim), tokens * dim * out.element_size())
    lib, dtype = load(), DTYPES[out.dtype]

    def kernel(at: list[int], count: int) -> None:
        if lib.kv_fp8_decode(at[0], at[1], at[2], dtype, count, tokens, dim, per_token) != 0:
            raise ValueError(f"fp8 decode refused dtype {out.dtype}")

    return _ranges(kernel, (codes, scale, out), rows, rows[2], outer)


def decode_blocks_calls(
    ptrs: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, geometry: tuple[int, ...]
) -> list[Call]:
    """The calls that decode one layer of a load's fp8 chunks straight into the blocks of
    an engine's cache ``out`` (CPU, contiguous): ``ptrs`` int64 ``[chunks, 4]``, per chunk
    the addresses of the layer's K codes ``[H, T, D]``, V codes, K scales ``[H, D]`` and V
    scales ``[H, T]``; ``offsets`` int64, per chunk its ``T / N`` blocks' first elements in
    ``out``; ``geometry`` = (heads, T, D, N, head stride, K token stride, K dim stride, V
    offset, V token stride, V dim stride) in elements, K ``[D, N]`` and V ``[N, D]`` within
    a block (vLLM's CPU order). Every value written is checked to lie inside ``out`` first
    (ValueError)."""
    lib, dtype = load(), DTYPES.get(out.dtype)

    def kernel(at_ptrs: int, at_off: int, geo: int) -> int:
        return lib.kv_fp8_decode_blocks(at_ptrs, at_off, out.data_ptr(), dtype, geo)

    return _block_calls(kernel, 4, ptrs, offsets, out, geometry)


def copy_blocks_calls(
    ptrs: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, geometry: tuple[int, ...]
) -> list[Call]:
    """``decode_blocks_calls`` for ``raw`` chunks: ``ptrs`` int64 ``[chunks, 2]``, per chunk
    the addresses of the layer's K and V ``[H, T, D]`` in ``out``'s own dtype, copied."""
    lib = load()

    def kernel(at_ptrs: int, at_off: int, geo: int) -> int:
        return lib.kv_copy_blocks(at_ptrs, at_off, out.data_ptr(), out.element_size(), geo)

    return _block_calls(kernel, 2, ptrs, offsets, out, geometry)


def _block_calls(
    kernel: Callable[[int, int, int], int],
    width: int,
    ptrs: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    geometry: tuple[int, ...],
) -> list[Call]:
    heads, tokens, dim, n, sh, ksn, ksd, voff, vsn, vsd = geometry
    chunks = ptrs.shape[0]
    if out.dtype not in DTYPES or not usable(out) or n <= 0 or tokens % n:
        raise ValueError("paged blocks: unsupported cache or geometry")
    if (ksn, vsd, vsn) != (1, 1, dim):
        raise ValueError("paged blocks: only blocks of K [D, N] and V [N, D] are written")
    per_chunk = tokens // n
    if ptrs.shape != (chunks, width) or offsets.numel() != chunks * per_chunk:
        raise ValueError("paged blocks: pointers or offsets do not match the chunks")
    if ptrs.dtype != torch.int64 or offsets.dtype != torch.int64 or not offsets.is_contiguous():
        raise ValueError("paged blocks: pointers and offsets must be contiguous int64")
    extent = (heads - 1) * sh + max((dim - 1) * ksd + n - 1, voff + n * dim - 1)
    if chunks and (
        min(sh, ksd, voff) < 0
        or int(offsets.min()) < 0
        or int(offsets.max()) + extent >= out.numel()
    ):
        raise ValueError("paged blocks: a block would be written outside the cache")
    ptrs = ptrs.contiguous()

    def call(at: list[int], count: int) -> None:
        geo = torch.tensor([count, *geometry], dtype=torch.int64)
        if kernel(at[0], at[1], geo.data_ptr()) != 0:
            raise ValueError(f"paged blocks: the kernel refused {out.dtype}")

    values_chunk = 2 * heads * tokens * dim * out.element_size()
    rows = (width * 8, per_chunk * 8)  # bytes of pointers and of offsets per chunk
    return _ranges(call, (ptrs, offsets), rows, values_chunk, chunks)


def run(calls: list[Call]) -> None:
    """The calls, spread over the host's cores where they are large enough to pay."""
    spread([c for c, _ in calls], [w for _, w in calls])


def encode_into(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, per_token: bool) -> None:
    """``encode_calls``, run."""
    run(encode_calls(x, codes, scale, per_token))


def decode_into(
    codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, per_token: bool
) -> None:
    """``decode_calls``, run."""
    run(decode_calls(codes, scale, out, per_token))
