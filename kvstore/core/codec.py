"""Encode K/V tensors in the canonical layout to chunk payloads and back (torch).

Offers ``encode(k, v, codec, out=None)`` (into ``out`` when given: ``payload_len`` bytes),
``decode(payload, device=None)``, ``decode_many(payloads)``
(a load's chunks, fp8 dequantised in one call; its checksums may be left to
``checked_prefix(payloads)``, run alongside) and ``compile_kernels(shape, dtype)``
(fast fp8 kernels, warmed once: the C loops of ``fp8_cpu`` for CPU tensors, fused with
``torch.compile`` for other devices; eager otherwise).

K and V are ``[layers, kv_heads, tokens, head_dim]`` tensors of one dtype.
``raw`` keeps that dtype bit for bit. ``fp8`` stores float8_e4m3 codes with
per-channel scales for K (``[L, H, D]``: keys carry outliers in fixed channels)
and per-token scales for V (``[L, H, T]``). Quantization runs on the tensors'
own device, so only half the bytes of bf16 ever leave an accelerator. The server never
imports it: the store validates headers (``kvstore.core.payload``) and never decodes a body.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from kvstore.core import fp8_cpu
from kvstore.core.fp8_blocks import DeferredChunk, Fp8Batch
from kvstore.core.lanes import spread
from kvstore.core.payload import (
    HEADER_BYTES,
    ChunkHeader,
    expected_body_len,
    parse_header,
    parse_payload,
    seal_payload,
)
from kvstore.core.types import InvalidArgument, PayloadError

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


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


def _quantize(x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=reduce_dim, keepdim=True).clamp_min(1e-12) / FP8_MAX
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale.squeeze(reduce_dim)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


class _Kernels:
    """Eager torch until ``compile_kernels`` swaps in fused ones (one pass over memory
    instead of four or five temporaries; 0.4-1.0 GB/s eager against 5.7-9 fused here).
    ``dequantize_many`` takes a leading chunk dimension of any size (compiled with dynamic
    shapes, so a new count of chunks never recompiles). ``native``: CPU tensors go through
    ``fp8_cpu``'s loops instead (torch's fused kernels convert e4m3 one value at a time on
    CPU: 1-2 GB/s on an AVX2 host, against ~3 encode and ~8 decode for those loops)."""

    quantize = staticmethod(_quantize)
    dequantize = staticmethod(_dequantize)
    dequantize_many = staticmethod(_dequantize)
    compiled = False
    native = False


def _native_agrees(shape: tuple[int, int, int, int], dtype: torch.dtype) -> bool:
    """The C loops give the eager kernels' bytes, codes and scales and values, on one chunk."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    for dim, per_token in ((2, False), (3, True)):
        want_codes, want_scale = _quantize(x, dim)
        codes, scale = torch.empty(shape, dtype=torch.uint8), torch.empty(want_scale.shape)
        fp8_cpu.encode_into(x, codes, scale, per_token)
        same = torch.equal(codes, want_codes.view(torch.uint8))
        if not (same and torch.equal(scale, want_scale)):
            return False
        values = torch.empty(shape, dtype=dtype)
        fp8_cpu.decode_into(codes, scale, values, per_token)
        if not torch.equal(values, _dequantize(want_codes, want_scale.unsqueeze(dim), dtype)):
            return False
    return True


def compile_kernels(shape: tuple[int, int, int, int], dtype: torch.dtype, device=None) -> bool:
    """Warm fast fp8 kernels on one chunk of ``shape``: on CPU, ``fp8_cpu``'s C loops (built
    once per host, ~1 s, and checked to give the eager kernels' bytes); elsewhere, or where
    they cannot be built, the kernels fused with ``torch.compile`` (~14 s once, here rather
    than on the first save or load).

    Returns False, leaving eager kernels in place, where neither works (no compiler).
    """
    on_cpu = torch.device(device or "cpu").type == "cpu"
    if on_cpu and not _Kernels.native and fp8_cpu.load() is not None:
        _Kernels.native = _native_agrees(shape, dtype)
        if not _Kernels.native:
            log.warning("fp8 CPU kernels disagree with torch's eager ones; not used")
    if on_cpu and _Kernels.native:
        return True
    if _Kernels.compiled:
        return True
    try:
        quantize = torch.compile(_quantize, dynamic=False)
        dequantize = torch.compile(_dequantize, dynamic=False)
        dequantize_many = torch.compile(_dequantize, dynamic=True)
        x = torch.randn(shape, device=device).to(dtype)
        for dim in (2, 3):
            codes, scale = quantize(x, dim)
            want, _ = _quantize(x, dim)
            dequantize(codes, scale.unsqueeze(dim), dtype)
            agree = (codes.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
            if agree < 0.99:
                raise RuntimeError(f"fused fp8 codes agree with eager on only {agree:.4f}")
            # two chunks: sizes 0 and 1 would be specialised, 2 and up share one kernel
            pair = (torch.stack([codes, codes]), torch.stack([scale, scale]).unsqueeze(dim + 1))
            if not torch.equal(dequantize_many(*pair, dtype), _dequantize(*pair, dtype)):
                raise RuntimeError("fused fp8 batch dequantisation disagrees with eager")
    except Exception as exc:
        log.warning("fp8 codec stays eager (torch.compile failed: %s)", exc)
        return False
    _Kernels.quantize, _Kernels.dequantize = quantize, dequantize
    _Kernels.dequantize_many = dequantize_many
    _Kernels.compiled = True
    return True


def quantize_fp8(x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and float32 scales, one scale per slice along all but ``reduce_dim``."""
    return _Kernels.quantize(x, reduce_dim)


def _new_payload(nbytes: int, out=None) -> memoryview:
    """Room for a payload the encoder fills whole (the body by the encoder, the header by
    ``seal_payload``): ``out`` when given (exactly ``nbytes``, writable), else a buffer of
    its own, not zeroed first, unlike a ``bytearray``, whose memset of a 4 MiB chunk cost
    0.18 ms of a 1.8 ms fp8 encode here."""
    if out is None:
        return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    room = memoryview(out).cast("B")
    if room.readonly or room.nbytes != nbytes:
        raise InvalidArgument(
            f"encode needs a writable buffer of exactly {nbytes} bytes for this payload, "
            f"got {room.nbytes}{' read-only' if room.readonly else ''}"
        )
    return room


def payload_len(k: torch.Tensor, v: torch.Tensor, codec: str) -> int:
    """Bytes of the payload ``encode(k, v, codec)`` makes, header included."""
    src = _check_kv(k, v)
    if codec not in ("raw", "fp8"):
        raise InvalidArgument(f"unknown codec {codec!r}; expected 'raw' or 'fp8'")
    return HEADER_BYTES + expected_body_len(codec, src, k.shape)


def encode(k: torch.Tensor, v: torch.Tensor, codec: str, out=None) -> memoryview:
    """One chunk part as a payload (header + body): a writable buffer of its own, or
    written into ``out`` (a writable buffer of exactly ``payload_len`` bytes: a store's
    shared-memory room, say, so that the payload is written once, where it is kept)."""
    src = _check_kv(k, v)
    header = ChunkHeader(codec, src, *k.shape, body_len=expected_body_len(codec, src, k.shape))
    if codec == "fp8" and _Kernels.native and fp8_cpu.usable(k, v):
        return _encode_fp8_native(k, v, header, out)
    if codec == "raw":
        parts = [k, v]
    elif codec == "fp8":
        k_codes, k_scale = quantize_fp8(k, reduce_dim=2)  # per channel: reduce over tokens
        v_codes, v_scale = quantize_fp8(v, reduce_dim=3)  # per token: reduce over head_dim
        parts = [k_codes, v_codes, k_scale, v_scale]
    else:
        raise InvalidArgument(f"unknown codec {codec!r}; expected 'raw' or 'fp8'")
    out = _new_payload(HEADER_BYTES + header.body_len, out)
    body = torch.frombuffer(out, dtype=torch.uint8)[HEADER_BYTES:]
    at = 0
    for part in parts:  # each part copied once, straight into the payload
        n = part.numel() * part.element_size()
        body[at : at + n].view(part.dtype).view(part.shape).copy_(part)
        at += n
    seal_payload(header, out)
    return out


def _fp8_parts(body: torch.Tensor, shape) -> tuple[torch.Tensor, ...]:
    """K codes, V codes, K scales (per channel), V scales (per token): views of an fp8 body."""
    layers, heads, tokens, dim = shape
    n, k_scales = layers * heads * tokens * dim, 4 * layers * heads * dim
    return (
        body[:n],
        body[n : 2 * n],
        body[2 * n : 2 * n + k_scales].view(torch.float32),
        body[2 * n + k_scales : 2 * n + k_scales + 4 * layers * heads * tokens].view(torch.float32),
    )


def _encode_fp8_native(
    k: torch.Tensor, v: torch.Tensor, header: ChunkHeader, out=None
) -> memoryview:
    """fp8 through the C loops, codes and scales written straight into the payload."""
    out = _new_payload(HEADER_BYTES + header.body_len, out)
    k_codes, v_codes, k_scale, v_scale = _fp8_parts(
        torch.frombuffer(out, dtype=torch.uint8)[HEADER_BYTES:], k.shape
    )
    calls = fp8_cpu.encode_calls(k, k_codes, k_scale, per_token=False)
    fp8_cpu.run(calls + fp8_cpu.encode_calls(v, v_codes, v_scale, per_token=True))
    seal_payload(header, out)
    return out


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
    return _decode_parsed(*parse_payload(payload), device)


def _native(device: torch.device | str | None) -> bool:
    return _Kernels.native and (device is None or torch.device(device).type == "cpu")


class DecodedChunks(list):
    """``decode_many``'s answer: (K, V) per chunk (raw chunks' views and deferred fp8
    chunks are made on first use: ``DeferredChunk``); where they are slices of one batch
    (fp8, two chunks or more), ``stacked`` is that batch, K and V ``[chunks, L, H, T, D]``;
    with ``defer_fp8``, an ``Fp8Batch`` (not decoded yet; each chunk a ``DeferredChunk``).
    ``shape`` is the chunks' ``(L, H, T, D)`` (None for no chunk)."""

    stacked: tuple[torch.Tensor, torch.Tensor] | Fp8Batch | None = None
    shape: tuple[int, int, int, int] | None = None


def decode_many(
    payloads,
    device: torch.device | str | None = None,
    defer_fp8: bool = False,
    checksums: bool = True,
) -> tuple[DecodedChunks, PayloadError | None]:
    """``decode`` of a load's payloads, stopping at the first that is invalid or differs
    from the first in codec, dtype or shape: the (K, V) of those before it, and the error.
    Without ``checksums`` only the headers are checked here: the caller must not trust
    what it writes from them until ``checked_prefix`` says so.

    fp8 chunks are dequantised in one call for all of them (``[chunks, L, H, T, D]``):
    per chunk, dispatching the kernels cost several times the arithmetic (16 chunks of
    the ttft model: 0.9 ms batched against 3-6 ms one by one, here). With ``defer_fp8``,
    where the CPU loops run them, fp8 chunks are only checked (header and checksum) and
    ``stacked`` is an ``Fp8Batch`` that decodes each layer straight into a paged cache.
    """
    parsed: list[tuple[ChunkHeader, memoryview]] = []
    error: PayloadError | None = None
    # the checksums run without the GIL: a load's payloads are checked on all lanes (16K
    # tokens of raw in one thread cost 5.5 ms of a 15 ms load in an engine here)
    if checksums:
        checked = spread(
            [functools.partial(_parse_or_error, p) for p in payloads],
            [memoryview(p).nbytes for p in payloads],
        )
    else:
        checked = [_header_or_error(p) for p in payloads]
    for result in checked:
        if isinstance(result, PayloadError):
            error = result
            break
        header, body = result
        if parsed and header != parsed[0][0]:
            error = PayloadError(f"a load's chunks differ: {header} after {parsed[0][0]}")
            break
        parsed.append((header, body))
    out = _decode_parsed_many(parsed, device, defer_fp8)
    out.shape = parsed[0][0].shape if parsed else None
    return out, error


def checked_prefix(payloads) -> int:
    """How many leading ``payloads`` pass ``parse_payload`` (header and checksum), on the
    calling thread: ``decode_many(..., checksums=False)``'s other half, run meanwhile."""
    for i, payload in enumerate(payloads):
        if isinstance(_parse_or_error(payload), PayloadError):
            return i
    return len(payloads)


def _parse_or_error(payload) -> tuple[ChunkHeader, memoryview] | PayloadError:
    try:
        return parse_payload(payload)
    except PayloadError as exc:
        return exc


def _header_or_error(payload) -> tuple[ChunkHeader, memoryview] | PayloadError:
    try:
        header = parse_header(payload)
    except PayloadError as exc:
        return exc
    return header, memoryview(payload).cast("B")[HEADER_BYTES:]


def _decode_parsed_many(parsed, device, defer_fp8: bool) -> DecodedChunks:
    if len(parsed) < 2 or parsed[0][0].codec != "fp8":
        if device is None and parsed and parsed[0][0].codec == "raw":
            # views of the bodies, made on first use: a load written from its stacked
            # batch never asks for them (64 chunks' views: 0.5 ms of a 16K-token load)
            return DecodedChunks(
                DeferredChunk(functools.partial(_decode_parsed, h, b, None)) for h, b in parsed
            )
        return DecodedChunks(_decode_parsed(h, b, device) for h, b in parsed)
    header = parsed[0][0]
    layers, heads, tokens, dim = shape = header.shape
    n, k_scales = layers * heads * tokens * dim, 4 * layers * heads * dim
    raws = [_body_tensor(body, copy=False) for _, body in parsed]
    if _native(device) and defer_fp8:
        batch = Fp8Batch(
            raws,
            shape,
            _TORCH_DTYPES[header.src_dtype],
            lambda j: _decode_parsed(*parsed[j], device),
        )
        out = DecodedChunks(
            DeferredChunk(functools.partial(batch.chunk, j)) for j in range(len(raws))
        )
        out.stacked = batch
        return out
    if _native(device):  # each chunk straight into its slot of the batch, no stacking
        dtype = _TORCH_DTYPES[header.src_dtype]
        k, v = (torch.empty((len(raws), *shape), dtype=dtype) for _ in range(2))
        calls = []  # every chunk's, spread over the cores in one hand-off
        for i, raw in enumerate(raws):
            k_codes, v_codes, k_scale, v_scale = _fp8_parts(raw, shape)
            calls += fp8_cpu.decode_calls(k_codes, k_scale, k[i], per_token=False)
            calls += fp8_cpu.decode_calls(v_codes, v_scale, v[i], per_token=True)
        fp8_cpu.run(calls)
        out = DecodedChunks((k[i], v[i]) for i in range(len(raws)))
        out.stacked = (k, v)
        return out
    if device is not None:
        raws = [r.to(device) for r in raws]

    def stacked(start: int, end: int) -> torch.Tensor:  # one small copy per part
        return torch.stack([r[start:end] for r in raws])

    count, dtype = len(raws), _TORCH_DTYPES[header.src_dtype]
    k_codes = stacked(0, n).view(FP8).reshape(count, *shape)
    v_codes = stacked(n, 2 * n).view(FP8).reshape(count, *shape)
    k_scale = stacked(2 * n, 2 * n + k_scales).view(torch.float32)
    v_scale = stacked(2 * n + k_scales, header.body_len).view(torch.float32)
    k = _Kernels.dequantize_many(k_codes, k_scale.reshape(count, layers, heads, 1, dim), dtype)
    v = _Kernels.dequantize_many(v_codes, v_scale.reshape(count, layers, heads, tokens, 1), dtype)
    out = DecodedChunks((k[i], v[i]) for i in range(count))
    out.stacked = (k, v)
    return out


def _decode_parsed(
    header: ChunkHeader, body: memoryview, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = header.shape
    dtype = _TORCH_DTYPES[header.src_dtype]
    if header.codec == "raw" and device is None:  # the common load: views, three torch calls
        if body.nbytes != header.body_len:
            raise PayloadError("body length changed while decoding")
        kv = torch.frombuffer(bytearray(body) if body.readonly else body, dtype=dtype)
        kv = kv.view(2, *shape)
        return kv[0], kv[1]
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
    k_codes, v_codes, k_scale, v_scale = _fp8_parts(raw, shape)
    if _native(device):
        k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        calls = fp8_cpu.decode_calls(k_codes, k_scale, k, per_token=False)
        fp8_cpu.run(calls + fp8_cpu.decode_calls(v_codes, v_scale, v, per_token=True))
        return k, v
    layers, heads, tokens, dim = shape
    k_codes, v_codes = (c.view(FP8).reshape(shape) for c in (k_codes, v_codes))
    k = _Kernels.dequantize(k_codes, k_scale.reshape(layers, heads, 1, dim), dtype)
    v = _Kernels.dequantize(v_codes, v_scale.reshape(layers, heads, tokens, 1), dtype)
    return k, v


__all__ = [
    "HEADER_BYTES",
    "compile_kernels",
    "decode",
    "DecodedChunks",
    "Fp8Batch",
    "decode_many",
    "checked_prefix",
    "dtype_name",
    "encode",
    "payload_len",
    "quantize_fp8",
]
