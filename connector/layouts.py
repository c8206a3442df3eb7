"""Adapters between an engine's paged KV cache (one tensor per layer) and canonical K/V.

Canonical (see ``kvstore.core.codec``): per layer, K and V as ``[kv_heads, tokens, head_dim]``; a
chunk stacks layers into ``[layers, kv_heads, tokens, head_dim]``.

Offers:

- ``PagedLayout``: the protocol. ``gather(kv_layer, block_ids, out=None) -> (k, v)`` copies
  the given blocks out of one layer's cache, in order, as ``[kv_heads, len(block_ids) *
  block_size, head_dim]`` (into ``out``'s two contiguous tensors when given: a chunk's
  stacked layers, say); ``scatter(kv_layer, block_ids, k, v)`` writes such tensors back in place.
  Both are vectorized: one ``index_select`` / ``index_copy_`` over the cache's block dim and
  one reorder of just those blocks; the caller loops over layers.
- ``CpuLayout(block_size, head_dim, amx)``: vLLM's CPU attention backend (``CPU_ATTN``).
- ``FlashLayout(block_size)``: the GPU backends (flash-attn, FlashInfer, Triton, ...).
- ``detect_cpu_isa``, ``detect_cpu_layout``, ``layout_for``: pick the layout for an engine.
- ``kernel_block_ids``: manager block ids to the cache tensor's (kernel) block ids.

A layout never writes a block of the cache it was not given.

Block ids are the scheduler's (KV-manager) block ids. vLLM may split a manager block into
``block_size // kv_layer.shape[2]`` kernel blocks; both layouts expand the ids accordingly.

Layouts (vLLM 0.32; per-layer tensor as handed to ``register_kv_caches``):

- Every backend gets the logical view ``[num_blocks, num_kv_heads, block_size, C]``
  (``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``); its physical strides follow the
  resolved ``KVCacheLayout``. Both layouts below index logically, so any stride order works.
- GPU: ``C = 2 * head_dim``, K in ``[..., :head_dim]`` and V in ``[..., head_dim:]``
  (``flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).
- CPU: the block interior of each head is raw memory for the C++ kernel: its first
  ``block_size * head_dim`` values hold K and the rest V (``cpu_attn.py``:
  ``kv_cache.view(B, H, 2 * N, -1).chunk(2, dim=2)``), in an ISA-specific order
  (``csrc/cpu/cpu_attn_vec.hpp`` / ``cpu_attn_amx.hpp`` ``reshape_and_cache``), N tokens, D dims:
  ``vec`` / ``vec16`` / non-bf16 ``neon``: K ``[D, N]`` (column-major), V ``[N, D]``;
  ``amx`` (bf16 on AMX hosts): K ``[N/16, D/2, 16, 2]``, V ``[D/16, N/2, 16, 2]``.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from kvstore.core import fp8_cpu
from kvstore.core.fp8_blocks import raw_into_blocks

BlockIds = Sequence[int] | Tensor

# ISAs whose CPU cache block order is K [D, N], V [N, D] (vLLM's "VEC" reshape_and_cache).
_VEC_ISAS = frozenset({"vec", "vec16", "neon"})
# AMX tiles: 16 rows of 64 bytes; the K/V packing below is derived from them for 2-byte dtypes.
_AMX_ROWS = 16


@runtime_checkable
class PagedLayout(Protocol):
    """Moves whole blocks between one layer's paged cache and canonical ``[H, T, D]`` K and V."""

    block_size: int

    def gather(
        self, kv_layer: Tensor, block_ids: BlockIds, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def scatter(self, kv_layer: Tensor, block_ids: BlockIds, k: Tensor, v: Tensor) -> None: ...

    def scatter_many(
        self, kv_layer: Tensor, block_ids: BlockIds, parts: Sequence[tuple[Tensor, Tensor]]
    ) -> None: ...


def kernel_block_ids(kv_layer: Tensor, block_ids: BlockIds, block_size: int) -> Tensor:
    """The cache tensor's block indices for manager ``block_ids`` (int64, on its device).

    vLLM views a manager block of ``block_size`` tokens as ``block_size // N`` consecutive kernel
    blocks of ``N = kv_layer.shape[2]`` tokens (``vllm/v1/worker/utils.py``), so block ``b``
    covers kernel blocks ``b * r ... b * r + r - 1``.
    """
    kernel = kv_layer.shape[2]
    if block_size % kernel:
        raise ValueError(f"block_size {block_size} is not a multiple of the cache's {kernel}")
    ratio = block_size // kernel
    if isinstance(block_ids, Tensor):
        ids = block_ids.to(torch.int64).reshape(-1)
        if ids.device.type == "cpu":
            _check_range(ids, kv_layer.shape[0] // ratio)
        ids = ids.to(kv_layer.device)
    else:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        _check_range(ids, kv_layer.shape[0] // ratio)
        ids = ids.to(kv_layer.device)
    if ratio > 1:
        ids = (ids[:, None] * ratio + torch.arange(ratio, device=ids.device)).reshape(-1)
    return ids


def _check_range(ids: Tensor, num_blocks: int) -> None:
    # An out-of-range index is a device-side assert on CUDA; catch it here while it is cheap.
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"block ids must lie in [0, {num_blocks}), got {ids.tolist()}")


def _check_kv(k: Tensor, v: Tensor, shape: tuple[int, int, int]) -> None:
    if tuple(k.shape) != shape or tuple(v.shape) != shape:
        raise ValueError(
            f"K and V must be {list(shape)} (kv_heads, tokens, head_dim), got "
            f"{list(k.shape)} and {list(v.shape)}"
        )


class _BlockViews:
    """Shared gather/scatter over per-layout views ``[H, blocks, <token dims>, <dim dims>]``.

    A subclass views a ``[blocks, H, N, C]`` tensor, without copying, as K and V whose dim 1 is
    the block and whose other dims, read in order, run token-major then head_dim, so that a
    reshape to ``[H, blocks * N, D]`` is the canonical order. Only the selected blocks are ever
    copied: ops on a permuted view of the whole cache would copy the whole cache.
    """

    block_size: int

    def _views(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _head_dim(self, kv_layer: Tensor) -> int:
        raise NotImplementedError

    def gather(
        self, kv_layer: Tensor, block_ids: BlockIds, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        ids = kernel_block_ids(kv_layer, block_ids, self.block_size)
        heads, tokens = kv_layer.shape[1], ids.numel() * kv_layer.shape[2]
        d = self._head_dim(kv_layer)
        k_view, v_view = self._views(kv_layer.index_select(0, ids))  # a copy of those blocks
        if out is None:
            out = tuple(
                torch.empty((heads, tokens, d), dtype=kv_layer.dtype, device=kv_layer.device)
                for _ in range(2)
            )
        for dest, view in zip(out, (k_view, v_view), strict=True):
            if tuple(dest.shape) != (heads, tokens, d) or not dest.is_contiguous():
                raise ValueError(
                    f"gather writes contiguous [{heads}, {tokens}, {d}] K and V, "
                    f"got {list(dest.shape)}"
                )
            # the view's dims run token-major then head_dim: the canonical order, reshaped
            dest.view(view.shape).copy_(view)
        return out

    def scatter(self, kv_layer: Tensor, block_ids: BlockIds, k: Tensor, v: Tensor) -> None:
        tokens = len(block_ids) * self.block_size
        _check_kv(k, v, (kv_layer.shape[1], tokens, self._head_dim(kv_layer)))
        self.scatter_many(kv_layer, block_ids, [(k, v)])

    def scatter_many(
        self, kv_layer: Tensor, block_ids: BlockIds, parts: Sequence[tuple[Tensor, Tensor]]
    ) -> None:
        """``scatter`` of several K/V parts whose blocks follow one another in ``block_ids``
        (a prefix's chunks): one staging buffer and one indexed copy for all of them. A
        part is ``[H, tokens, D]``, or ``[m, H, T, D]`` for m chunks of T tokens stacked
        (one copy for all of them: a copy per chunk cost more than its bytes)."""
        ids = kernel_block_ids(kv_layer, block_ids, self.block_size)
        heads, n = kv_layer.shape[1], kv_layer.shape[2]
        d = self._head_dim(kv_layer)
        sizes = [_part_tokens(k) for k, _ in parts]
        if sum(sizes) != ids.numel() * n or any(t % n for t in sizes):
            raise ValueError(
                f"K/V parts of {sizes} tokens do not fill {ids.numel()} blocks of {n} tokens"
            )
        if not ids.numel():
            return
        # whole blocks in the engine's order first (K and V fill every value of a block) ...
        blocks = torch.empty(
            (ids.numel(), *kv_layer.shape[1:]), dtype=kv_layer.dtype, device=kv_layer.device
        )
        k_view, v_view = self._views(blocks)
        at = 0
        for (k, v), tokens in zip(parts, sizes, strict=True):
            k_part, v_part = k_view[:, at : at + tokens // n], v_view[:, at : at + tokens // n]
            if k.dim() == 3:
                _check_kv(k, v, (heads, tokens, d))
                k_part.copy_(k.reshape(k_part.shape))
                v_part.copy_(v.reshape(v_part.shape))
            else:  # [m, H, T, D] -> [H, m, T/n, <block dims>]: chunk-major blocks
                m, t = k.shape[0], k.shape[2]
                for x in (k, v):
                    if tuple(x.shape) != (m, heads, t, d) or t % n:
                        raise ValueError(
                            f"stacked K/V must be [chunks, {heads}, T, {d}] with T a multiple "
                            f"of {n}, got {list(k.shape)} and {list(v.shape)}"
                        )
                for part, x in ((k_part, k), (v_part, v)):
                    dst = part.unflatten(1, (m, t // n))
                    dst.copy_(x.transpose(0, 1).reshape(heads, m, t // n, *part.shape[2:]))
            at += tokens // n
        # ... then one indexed copy into the engine's cache, in place
        kv_layer.index_copy_(0, ids, blocks)


def _part_tokens(k: Tensor) -> int:
    if k.dim() == 3:
        return k.shape[1]
    if k.dim() == 4:
        return k.shape[0] * k.shape[2]
    return -1


class CpuLayout(_BlockViews):
    """vLLM's CPU attention cache: ``[num_blocks, num_kv_heads, N, 2 * head_dim]``.

    Per block and head, K fills the first ``N * D`` values and V the next ``N * D``. Without AMX
    (``vec``/``vec16``/``neon`` kernels, any dtype) K is stored ``[D, N]`` and V ``[N, D]``. With
    AMX (bf16) K is ``[N/16, D/2, 16, 2]`` (16-token groups of dim pairs) and V is
    ``[D/16, N/2, 16, 2]`` (16-dim groups of token pairs), as the AMX tile loads want them.
    """

    def __init__(self, block_size: int, head_dim: int, amx: bool = False) -> None:
        if block_size % 32:
            raise ValueError(f"vLLM's CPU backend needs block_size % 32 == 0, got {block_size}")
        if amx and head_dim % _AMX_ROWS:
            raise ValueError(f"the AMX layout needs head_dim % 16 == 0, got {head_dim}")
        self.block_size = block_size
        self.head_dim = head_dim
        self.amx = amx

    def __repr__(self) -> str:
        return f"CpuLayout(block_size={self.block_size}, head_dim={self.head_dim}, amx={self.amx})"

    def _head_dim(self, kv_layer: Tensor) -> int:
        return self.head_dim

    def _views(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        nb, heads, n, c = blocks.shape
        d = self.head_dim
        if c != 2 * d:
            raise ValueError(f"CPU cache has {c} values per token, expected 2 * head_dim = {2 * d}")
        # [B, H, 2, N*D]: the kernel's own split of each head's block into K then V
        halves = blocks.view(nb, heads, 2, n * d).transpose(0, 1)  # [H, B, 2, N*D]
        k_raw, v_raw = halves[:, :, 0], halves[:, :, 1]
        if not self.amx:
            k = k_raw.unflatten(-1, (d, n)).transpose(-1, -2)  # [H, B, N, D]
            v = v_raw.unflatten(-1, (n, d))
            return k, v
        if blocks.element_size() != 2:
            raise ValueError(f"the AMX layout packs 2-byte values, the cache is {blocks.dtype}")
        g = _AMX_ROWS
        # K[g, j, t, p] = key[token g*16 + t, dim 2j + p] -> [H, B, g, t, j, p]
        k = k_raw.unflatten(-1, (n // g, d // 2, g, 2)).permute(0, 1, 2, 4, 3, 5)
        # V[i, s, j, p] = value[token 2s + p, dim 16i + j] -> [H, B, s, p, i, j]
        v = v_raw.unflatten(-1, (d // g, n // 2, g, 2)).permute(0, 1, 3, 5, 2, 4)
        return k, v

    def direct_strides(self, kv_layer: Tensor) -> tuple[int, ...] | None:
        """Where K and V values lie in one block of a contiguous CPU cache, for writers that
        skip the staging copy (``Fp8Batch.into_blocks``): (N, head stride, K token and dim
        strides, V offset, V token and dim strides), in elements; None where the cache is
        not such a tensor or the order is not strided (AMX)."""
        if self.amx or kv_layer.device.type != "cpu" or not kv_layer.is_contiguous():
            return None
        if kv_layer.dim() != 4 or kv_layer.shape[3] != 2 * self.head_dim:
            return None
        _, _, n, c = kv_layer.shape
        d = self.head_dim
        return (n, n * c, 1, n, n * d, d, 1)  # K [D, N], then V [N, D] (see _views)

    def write_fp8(
        self, kv_layer: Tensor, block_ids: BlockIds, batch: Any, layer: int, first: int, last: int
    ) -> bool:
        """Decode layer ``layer`` of the fp8 chunks ``[first, last)`` of ``batch`` (an
        ``Fp8Batch``) straight into the blocks ``block_ids`` (as many as their tokens fill),
        with no staging copy; False, writing nothing, where this cache cannot take it so."""
        strides = self.direct_strides(kv_layer)
        if strides is None or kv_layer.dtype != batch.dtype:
            return False
        offsets = self._block_offsets(kv_layer, block_ids, last - first, batch.shape[2])
        batch.into_blocks(layer, first, last, kv_layer, offsets, strides)
        return True

    def write_raw(self, kv_layer: Tensor, block_ids: BlockIds, k: Tensor, v: Tensor) -> bool:
        """``scatter_many`` of one stacked part, K and V ``[chunks, H, T, D]`` of the cache's
        dtype (each chunk contiguous, as a load's chunks lie in their payloads), copied
        straight into the blocks ``block_ids`` with no staging copy; False, writing
        nothing, where the cache or the part is not such (then ``scatter_many`` does it)."""
        strides = self.direct_strides(kv_layer)
        if strides is None or k.dim() != 4 or fp8_cpu.load() is None:
            return False
        offsets = self._block_offsets(kv_layer, block_ids, k.shape[0], k.shape[2])
        return raw_into_blocks(k, v, kv_layer, offsets, strides)

    def _block_offsets(
        self, kv_layer: Tensor, block_ids: BlockIds, chunks: int, tokens: int
    ) -> Tensor:
        """The first element of each of ``block_ids``' kernel blocks, which ``chunks`` chunks
        of ``tokens`` tokens must fill exactly (ValueError)."""
        ids = kernel_block_ids(kv_layer, block_ids, self.block_size)
        _, heads, n, c = kv_layer.shape
        if ids.numel() * n != chunks * tokens or tokens % n:
            raise ValueError(f"{chunks} chunks do not fill {ids.numel()} blocks of {n}")
        return ids * (heads * n * c)


class FlashLayout(_BlockViews):
    """GPU backends' cache: logical ``[num_blocks, num_kv_heads, N, 2 * head_dim]``.

    K is ``[..., :head_dim]`` and V ``[..., head_dim:]`` of each (block, head, token) cell; the
    physical order (``LBNHC`` = the classic NHD, ``LBHNC`` = HND, ...) only changes strides,
    which indexing through the logical view absorbs.
    """

    def __init__(self, block_size: int, head_dim: int | None = None) -> None:
        self.block_size = block_size
        self.head_dim = head_dim

    def __repr__(self) -> str:
        return f"FlashLayout(block_size={self.block_size}, head_dim={self.head_dim})"

    def _head_dim(self, kv_layer: Tensor) -> int:
        return self.head_dim or kv_layer.shape[-1] // 2

    def _views(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        if blocks.dim() != 4:
            raise ValueError(
                "expected the [num_blocks, kv_heads, block_size, 2 * head_dim] view of vLLM "
                f">= 0.32, got shape {list(blocks.shape)}"
            )
        d = self._head_dim(blocks)
        if blocks.shape[-1] != 2 * d:
            raise ValueError(f"cache has {blocks.shape[-1]} values per token, expected {2 * d}")
        per_head = blocks.transpose(0, 1)  # [H, B, N, 2D]
        return per_head[..., :d], per_head[..., d:]


# ---- choosing a layout -------------------------------------------------------------------


def _cfg(obj: Any, *path: str) -> Any:
    for name in path:
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


def _is_fp8(kv_cache_dtype: Any) -> bool:
    return kv_cache_dtype is not None and "fp8" in str(kv_cache_dtype)


def detect_cpu_isa(
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_cache_dtype: str | None = "auto",
) -> str:
    """The kernel variant vLLM's CPU backend picks for this model, as vLLM itself decides it.

    Asks vLLM (``cpu_attn._get_attn_isa``: ``vec16`` for head sizes that are multiples of 16 but
    not 32; ``amx`` for bf16 when ``torch.cpu._is_amx_tile_supported()``; ``neon`` on Arm; ...)
    and falls back to the same rules for x86/Arm when vLLM is not importable.
    """
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # no vLLM here (tests), or it moved: same rules, the common platforms
        return _fallback_cpu_isa(dtype, block_size, head_dim)
    return _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)


def _fallback_cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    # vllm/v1/attention/backends/cpu_attn.py _get_attn_isa (0.32), for x86 and Arm
    if head_dim % 32 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    return "vec"


def cpu_layout_for_isa(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> CpuLayout:
    """The ``CpuLayout`` of a CPU kernel variant; raises for the ones not verified here."""
    if isa == "amx":
        if dtype != torch.bfloat16:
            raise NotImplementedError(f"AMX CPU KV layout for {dtype} (only bf16 is known)")
        return CpuLayout(block_size, head_dim, amx=True)
    # Arm bf16 may use the BFMMLA kernel (when vLLM is built with ARM_BF16_SUPPORT), which packs
    # blocks differently (cpu_attn_neon_bfmmla.hpp): refuse rather than read wrong KV.
    if isa in _VEC_ISAS and not (isa == "neon" and dtype == torch.bfloat16):
        return CpuLayout(block_size, head_dim, amx=False)
    raise NotImplementedError(f"vLLM CPU KV layout for ISA {isa!r} with {dtype} is not supported")


def detect_cpu_layout(
    vllm_config: Any = None,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    kv_cache_dtype: str | None = None,
    layer_name: str | None = None,
) -> CpuLayout:
    """The ``CpuLayout`` of a vLLM CPU engine, from its config and/or explicit values.

    Explicit arguments win over ``vllm_config`` (``model_config.dtype``,
    ``cache_config.block_size`` / ``cache_dtype``, ``model_config.get_head_size()``). With
    ``layer_name``, the ISA vLLM's metadata builder stored on that attention layer (set before
    ``register_kv_caches``) is used when present: the engine's actual choice.
    """
    dtype = dtype or _cfg(vllm_config, "model_config", "dtype")
    block_size = block_size or _cfg(vllm_config, "cache_config", "block_size")
    if kv_cache_dtype is None:
        kv_cache_dtype = _cfg(vllm_config, "cache_config", "cache_dtype") or "auto"
    if head_dim is None and vllm_config is not None:
        head_dim = vllm_config.model_config.get_head_size()
    if dtype is None or block_size is None or head_dim is None:
        raise ValueError("need dtype, block_size and head_dim (or a vllm_config that has them)")
    if _is_fp8(kv_cache_dtype):
        raise NotImplementedError("fp8 KV caches on CPU use other block layouts")
    isa = None
    if layer_name is not None:
        ctx = _cfg(vllm_config, "compilation_config", "static_forward_context") or {}
        isa = getattr(ctx.get(layer_name), "isa", None)
    if isa is None:
        isa = detect_cpu_isa(dtype, block_size, head_dim, kv_cache_dtype)
    return cpu_layout_for_isa(isa, dtype, block_size, head_dim)


def layout_for(
    kv_layer: Tensor,
    vllm_config: Any = None,
    *,
    block_size: int | None = None,
    layer_name: str | None = None,
) -> PagedLayout:
    """The layout of one registered cache tensor: ``CpuLayout`` on CPU, else ``FlashLayout``."""
    block_size = block_size or _cfg(vllm_config, "cache_config", "block_size") or kv_layer.shape[2]
    head_dim = None
    if vllm_config is not None:
        head_dim = vllm_config.model_config.get_head_size()
    if kv_layer.device.type == "cpu":
        return detect_cpu_layout(
            vllm_config,
            dtype=kv_layer.dtype if vllm_config is None else None,
            block_size=block_size,
            head_dim=head_dim or kv_layer.shape[-1] // 2,
            layer_name=layer_name,
        )
    if _is_fp8(_cfg(vllm_config, "cache_config", "cache_dtype")):
        raise NotImplementedError("fp8 KV caches are not supported by FlashLayout")
    return FlashLayout(block_size, head_dim)


__all__ = [
    "BlockIds",
    "CpuLayout",
    "FlashLayout",
    "PagedLayout",
    "cpu_layout_for_isa",
    "detect_cpu_isa",
    "detect_cpu_layout",
    "kernel_block_ids",
    "layout_for",
]
