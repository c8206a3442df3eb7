"""Encode K/V tensors in the canonical layout to chunk payloads and back (torch).

Offers ``encode(k, v, codec)`` and ``decode(payload, device=None)``.

K and V are ``[layers, kv_heads, tokens, head_dim]`` tensors of one dtype.
``raw`` keeps that dtype bit for bit. ``fp8`` stores float8_e4m3 codes with
per-channel scales for K (``[L, H, D]``: keys carry outliers in fixed channels)
and per-token scales for V (``[L, H, T]``). Quantization runs on the tensors'
own device, so only half the bytes of bf16 ever leave an accelerator. The server never
imports it: the store validates headers (``kvstore.payload``) and never decodes a body.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kvstore.payload import (
    HEADER_BYTES,
    ChunkHeader,
    build_payload,
    expected_body_len,
    parse_payload,
)
from kvstore.types import InvalidArgument, PayloadError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> str:
    if k.dim() != 4 or k.shape != v.shape:
        raise InvalidArgument(
            f"K and V must both be [layers, kv_heads, tokens, head_dim], got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype or k.dtype not in _DTYPE_NAMES:
        raise InvalidArgument(f"K/V dtype must be one of {list(_TORCH_DTYPES)}, got {k.dtype}")
    return _DTYPE_NAMES[k.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The payload header's name for a K/V dtype."""
    if dtype not in _DTYPE_NAMES:
        raise InvalidArgument(f"K/V dtype must be one of {list(_TORCH_DTYPES)}, got {dtype}")
    return _DTYPE_NAMES[dtype]


def quantize_fp8(x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and float32 scales, one scale per slice along all but ``reduce_dim``."""
    xf = x.float()
    scale = xf.abs().amax(dim=reduce_dim, keepdim=True).clamp_min(1e-12) / FP8_MAX
    codes = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale.squeeze(reduce_dim)


def encode(k: torch.Tensor, v: torch.Tensor, codec: str) -> bytearray:
    """One chunk part as a payload (header + body)."""
    src = _check_kv(k, v)
    header = ChunkHeader(codec, src, *k.shape, body_len=expected_body_len(codec, src, k.shape))
    if codec == "raw":
        parts = [_as_bytes(k), _as_bytes(v)]
    elif codec == "fp8":
        k_codes, k_scale = quantize_fp8(k, reduce_dim=2)  # per channel: reduce over tokens
        v_codes, v_scale = quantize_fp8(v, reduce_dim=3)  # per token: reduce over head_dim
        parts = [_as_bytes(k_codes), _as_bytes(v_codes), _as_bytes(k_scale), _as_bytes(v_scale)]
    else:
        raise InvalidArgument(f"unknown codec {codec!r}; expected 'raw' or 'fp8'")
    return build_payload(header, np.concatenate(parts))


def _body_tensor(body: memoryview, copy: bool) -> torch.Tensor:
    """The body as uint8 without a copy where none is needed: fp8 only reads its codes into
    new tensors, and a writable body (a caller's staging buffer) is the caller's to alias."""
    if copy:
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)
    if body.readonly:
        with warnings.catch_warnings():  # read, never written: see above
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(body, dtype=torch.uint8)
    return torch.frombuffer(body, dtype=torch.uint8)


def decode(
    payload: bytes | bytearray | memoryview, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a payload and return (K, V) in its source dtype on ``device``.

    ``raw`` K and V are views of a writable ``payload`` (no copy): they are valid as
    long as the caller keeps its buffer unchanged."""
    header, body = parse_payload(payload)
    shape = header.shape
    dtype = _TORCH_DTYPES[header.src_dtype]
    raw = _body_tensor(body, copy=header.codec == "raw" and body.readonly)
    if raw.numel() != header.body_len:
        raise PayloadError("body length changed while decoding")
    if device is not None:
        raw = raw.to(device)
    if header.codec == "raw":
        half = raw.numel() // 2
        k = raw[:half].view(dtype).reshape(shape)
        v = raw[half:].view(dtype).reshape(shape)
        return k, v
    layers, heads, tokens, dim = shape
    n = layers * heads * tokens * dim
    k_codes = raw[:n].view(FP8).reshape(shape)
    v_codes = raw[n : 2 * n].view(FP8).reshape(shape)
    off = 2 * n
    k_scale = raw[off : off + 4 * layers * heads * dim].view(torch.float32)
    v_scale = raw[off + 4 * layers * heads * dim :].view(torch.float32)
    k = (k_codes.float() * k_scale.reshape(layers, heads, 1, dim)).to(dtype)
    v = (v_codes.float() * v_scale.reshape(layers, heads, tokens, 1)).to(dtype)
    return k, v


__all__ = ["HEADER_BYTES", "decode", "dtype_name", "encode", "quantize_fp8"]
