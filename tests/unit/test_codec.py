"""Chunk payloads: raw is bit-exact, fp8 stays within 3%, malformed input is refused."""

import struct

import pytest
import torch

from kvstore.core import codec
from kvstore.core.payload import HEADER_BYTES, parse_header, parse_payload
from kvstore.core.types import InvalidArgument, PayloadError

SHAPE = (4, 2, 32, 64)  # layers, kv_heads, tokens, head_dim


def kv_with_outliers(dtype=torch.bfloat16, seed=0):
    """K with a few channels 20x larger (as in real models), V without."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE, generator=g)
    k[..., [3, 17, 42]] *= 20.0
    v = torch.randn(SHAPE, generator=g)
    return k.to(dtype), v.to(dtype)


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_raw_round_trip_is_bit_exact(dtype):
    k, v = kv_with_outliers(dtype)
    k2, v2 = codec.decode(codec.encode(k, v, "raw"))
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)


def test_fp8_error_is_within_three_percent_and_halves_bf16():
    k, v = kv_with_outliers()
    raw = codec.encode(k, v, "raw")
    fp8 = codec.encode(k, v, "fp8")
    k2, v2 = codec.decode(fp8)
    assert k2.dtype == torch.bfloat16 and k2.shape == k.shape
    assert rel_l2(k2, k) <= 0.03
    assert rel_l2(v2, v) <= 0.03
    assert len(fp8) < 0.6 * len(raw)


def test_fp8_scales_are_per_channel_for_k_and_per_token_for_v():
    k, v = kv_with_outliers(torch.float32)
    k_codes, k_scale = codec.quantize_fp8(k, reduce_dim=2)
    v_codes, v_scale = codec.quantize_fp8(v, reduce_dim=3)
    assert k_scale.shape == (4, 2, 64) and v_scale.shape == (4, 2, 32)
    # an outlier channel gets its own, larger scale rather than crushing the others
    assert k_scale[0, 0, 3] > 5 * k_scale[0, 0, 0]


def test_header_describes_the_chunk():
    k, v = kv_with_outliers()
    header = parse_header(codec.encode(k, v, "fp8"))
    assert (header.codec, header.src_dtype, header.shape) == ("fp8", "bfloat16", SHAPE)


def test_shape_mismatch_is_refused():
    k, v = kv_with_outliers()
    with pytest.raises(Exception, match="layers, kv_heads"):
        codec.encode(k, v[:, :, :16], "raw")


def _payload():
    return bytearray(codec.encode(*kv_with_outliers(), "raw"))


def _mutations():
    def flip(offset):
        def f(p):
            p[offset] ^= 0x40
            return p

        return f

    def set_field(fmt, offset, value):
        def f(p):
            struct.pack_into(fmt, p, offset, value)
            return p

        return f

    return {
        "empty": lambda p: bytearray(),
        "short header": lambda p: p[: HEADER_BYTES - 1],
        "bad magic": flip(0),
        "future version": set_field("<H", 4, 99),
        "unknown codec": set_field("<B", 6, 9),
        "unknown dtype": set_field("<B", 7, 0),
        "zero layers": set_field("<H", 8, 0),
        "shape vs body": set_field("<I", 12, 31),
        "body_len lies": set_field("<Q", 20, 12),
        "truncated body": lambda p: p[:-1],
        "trailing bytes": lambda p: p + b"\0",
        "flipped body byte": flip(HEADER_BYTES + 100),
        "flipped last byte": flip(-1),
        "flipped checksum": flip(HEADER_BYTES - 1),
    }


# mutations that leave the header itself valid: only the checksum finds them
HEADER_ONLY_PASSES = {"flipped body byte", "flipped last byte", "flipped checksum"}


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_every_malformed_payload_raises_payload_error(case):
    bad = _mutations()[case](_payload())
    parse_payload(_payload())  # valid headers are remembered: that must not let these in
    for _ in range(2):
        with pytest.raises(PayloadError):
            parse_header(bad) if case not in HEADER_ONLY_PASSES else parse_payload(bad)
    with pytest.raises(PayloadError):
        parse_payload(bad)
    with pytest.raises(PayloadError):
        codec.decode(bad)


def test_the_unmodified_payload_parses():
    header, body = parse_payload(_payload())
    assert len(body) == header.body_len


def test_fused_fp8_kernels_agree_with_eager_within_the_same_tolerance(monkeypatch):
    # other tests keep the eager kernels; torch.compile's kernels, as on a GPU, not the C
    # loops a CPU gets (tests/unit/test_fp8_cpu.py)
    for name in ("quantize", "dequantize", "dequantize_many", "compiled", "native"):
        monkeypatch.setattr(codec._Kernels, name, getattr(codec._Kernels, name))
    monkeypatch.setattr(codec.fp8_cpu, "load", lambda: None)
    k, v = kv_with_outliers()
    eager = codec.encode(k, v, "fp8")
    eager_k, eager_v = codec.decode(eager)
    assert codec.compile_kernels(SHAPE, torch.bfloat16)
    fused = codec.encode(k, v, "fp8")
    n = 2 * k.numel()  # the codes; scales follow
    a = torch.frombuffer(fused, dtype=torch.uint8)[HEADER_BYTES : HEADER_BYTES + n]
    b = torch.frombuffer(eager, dtype=torch.uint8)[HEADER_BYTES : HEADER_BYTES + n]
    assert (a != b).sum().item() <= 0.001 * n  # multiply-by-reciprocal rounding only
    k2, v2 = codec.decode(fused)
    assert rel_l2(k2, k) <= 0.03 and rel_l2(v2, v) <= 0.03
    fused_k, fused_v = codec.decode(eager)
    assert torch.equal(fused_k, eager_k) and torch.equal(fused_v, eager_v)
    # the batch kernel (dynamic shapes): any number of chunks, equal to one-by-one decodes
    for count in (2, 3, 5):
        many, error = codec.decode_many([eager] * count)
        assert error is None and len(many) == count
        assert all(torch.equal(mk, eager_k) and torch.equal(mv, eager_v) for mk, mv in many)


@pytest.mark.parametrize("codec_name", ["raw", "fp8"])
def test_decode_many_equals_decode_one_by_one_and_stops_at_a_bad_payload(codec_name):
    payloads = [codec.encode(*kv_with_outliers(seed=i), codec_name) for i in range(4)]
    one_by_one = [codec.decode(p) for p in payloads]
    many, error = codec.decode_many(payloads)
    assert error is None and len(many) == 4
    for (k1, v1), (k2, v2) in zip(one_by_one, many, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    broken = bytearray(payloads[2])
    broken[-1] ^= 0xFF  # the checksum no longer matches
    many, error = codec.decode_many([payloads[0], payloads[1], bytes(broken), payloads[3]])
    assert isinstance(error, PayloadError) and len(many) == 2
    assert torch.equal(many[1][0], one_by_one[1][0])
    other = codec.encode(*(x[:, :, :16] for x in kv_with_outliers()), codec_name)
    many, error = codec.decode_many([payloads[0], other])
    assert len(many) == 1 and "differ" in str(error)
    assert codec.decode_many([]) == ([], None)


def test_a_paced_checksum_is_the_same_checksum_and_paces_each_piece():
    from kvstore.core.payload import PACE_PIECE

    k = torch.randn(2, 2, 2500, 64)  # ~5 MB of K and V: several pieces, the last short
    payload = bytearray(codec.encode(k, -k, "raw"))
    calls = []
    header, body = parse_payload(payload, pace=lambda: calls.append(1))
    assert len(body) > 4 * PACE_PIECE and len(body) % PACE_PIECE
    assert (header, bytes(body)) == (parse_header(payload), bytes(parse_payload(payload)[1]))
    assert len(calls) == -(-len(body) // PACE_PIECE)
    bad = bytearray(payload)
    bad[-1] ^= 1
    with pytest.raises(PayloadError):
        parse_payload(bad, pace=lambda: None)


@pytest.mark.parametrize(
    "codec_name, native", [("raw", False), ("fp8", False), ("fp8", True)], ids=str
)
def test_encode_into_a_caller_s_buffer_writes_the_same_payload_there(
    codec_name, native, monkeypatch
):
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 32, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 32, 64, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(codec._Kernels, "native", False)  # restored after the test
    want = bytes(codec.encode(k, v, codec_name))  # the eager kernels' bytes
    if native:  # fp8's C loops (what the connector runs on a CPU cache)
        assert codec.compile_kernels(tuple(k.shape), torch.bfloat16)
        assert codec._Kernels.native
    assert codec.payload_len(k, v, codec_name) == len(want)
    room = bytearray(b"\xaa" * len(want))  # stale bytes: every one must be written
    got = codec.encode(k, v, codec_name, out=room)
    assert bytes(room) == want and bytes(got) == want
    parse_payload(room)
    with pytest.raises(InvalidArgument, match="exactly"):
        codec.encode(k, v, codec_name, out=bytearray(len(want) + 1))
    with pytest.raises(InvalidArgument, match="read-only"):
        codec.encode(k, v, codec_name, out=bytes(len(want)))
    with pytest.raises(InvalidArgument, match="unknown codec"):
        codec.payload_len(k, v, "zstd")
