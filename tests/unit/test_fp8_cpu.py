"""The fp8 codec's C loops on CPU: the eager torch kernels' bytes, built once, optional."""

import gc
import logging
import os
import weakref

import pytest
import torch

from kvstore.core import codec, fp8_cpu

SHAPE = (3, 2, 16, 64)  # layers, kv_heads, tokens, head_dim
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(fp8_cpu.load() is None, reason="no C compiler here")


@pytest.fixture
def native(monkeypatch):
    """The C loops for this test only; eager torch before and after (monkeypatch restores)."""
    monkeypatch.setattr(codec._Kernels, "native", codec._Kernels.native)
    assert codec.compile_kernels(SHAPE, torch.bfloat16)
    assert codec._Kernels.native


def eager(fn, *args):
    was = codec._Kernels.native
    codec._Kernels.native = False
    try:
        return fn(*args)
    finally:
        codec._Kernels.native = was


def hard_kv(dtype, seed=0):
    """Outlier channels, values across 20 binades (fp8 subnormals included), an all-zero
    token, exact ±448 after scaling, round-to-even ties in the normal and subnormal range."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE, generator=g) * torch.exp2(
        torch.randint(-14, 6, (SHAPE[-1],), generator=g).float()
    )
    k[..., [3, 17]] *= 20.0
    v = torch.randn(SHAPE, generator=g)
    v[1, 1, 5, :] = 0.0
    # one V token whose amax is 448 (scale 1): its values are the codes' own grid
    ties = [448.0, -448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-10)]
    ties += [2.0**-7 + 2.0**-11, 240.0 + 8.0, 0.0, -0.0]
    v[0, 0, 0, : len(ties)] = torch.tensor(ties)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_payloads_and_values_are_the_eager_kernels_bytes(native, dtype):
    k, v = hard_kv(dtype)
    want = eager(codec.encode, k, v, "fp8")
    got = codec.encode(k, v, "fp8")
    assert bytes(got) == bytes(want)
    want_k, want_v = eager(codec.decode, want)
    for device in (None, "cpu"):
        got_k, got_v = codec.decode(want, device)
        assert got_k.dtype == dtype and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    many, error = codec.decode_many([want, codec.encode(*hard_kv(dtype, seed=1), "fp8")] * 2)
    assert error is None and len(many) == 4 and many.stacked[0].shape == (4, *SHAPE)
    assert torch.equal(many[0][0], want_k) and torch.equal(many[2][1], want_v)
    other_k, other_v = eager(codec.decode, codec.encode(*hard_kv(dtype, seed=1), "fp8"))
    assert torch.equal(many[3][0], other_k) and torch.equal(many[1][1], other_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_decodes_as_torch_converts_it(native, dtype):
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 4, 64)
    scale = torch.tensor([1.0, 0.5, 3.0, 1e-3]).reshape(1, 1, 4)
    out = torch.empty(codes.shape, dtype=dtype)
    fp8_cpu.decode_into(codes, scale, out, per_token=True)
    want = (codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)).to(dtype)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and nan.sum() == 2  # 0x7F and 0xFF
    assert torch.equal(out[~nan], want[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [True, False])
def test_vector_decoder_gives_every_code_under_every_scale_as_torch(native, dtype, per_token):
    """The vector decoder (32 codes a step, 2^120 folded into the scale where that is exact,
    a block with a NaN code left to the scalar loop): every finite code at 16 positions of
    a row, under scales from 1e-30 to 5e30 (those of 2^7 and above, inf and NaN not folded),
    rows with a NaN code in their middle, as torch's own conversion."""
    g = torch.Generator().manual_seed(3)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows = torch.stack([finite[torch.randperm(len(finite), generator=g)][:96] for _ in range(48)])
    rows[5, 40], rows[9, 3], rows[9, 90] = 0x7F, 0xFF, 0x7F  # NaN codes mid-row
    scales = [1.0, 0.37, 3e-3, 1e-30, 127.9, 128.0, 200.0, 5e30, float("inf"), 2.5e-7]
    scales += [float("nan"), -0.75, 300.0, 1e4]
    if per_token:  # [1, 1, tokens, dim]: one scale per row
        codes = rows.reshape(1, 1, 48, 96)
        scale = torch.tensor((scales * 4)[:48]).reshape(1, 1, 48)
        want = codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
    else:  # [outer, tokens, dim]: one scale per column of each slab
        codes = rows.reshape(4, 12, 96)
        scale = torch.tensor((scales * 32)[:384]).reshape(4, 96)
        scale[1] = torch.rand(96, generator=g) * 100  # a slab whose scales all fold
        want = codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(1)
    want = want.to(dtype)
    out = torch.empty(codes.shape, dtype=dtype)
    fp8_cpu.decode_into(codes, scale, out, per_token=per_token)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and nan.any()
    assert torch.equal(out[~nan].view(torch.uint8), want[~nan].view(torch.uint8))  # -0.0 too


def test_nan_and_inf_in_the_cache_spoil_only_their_own_slice_as_eager(native):
    k, v = hard_kv(torch.float32)
    k[0, 0, 2, 7], v[1, 0, 3, 9], v[2, 1, 4, 0] = float("nan"), float("inf"), float("-inf")
    got = codec.decode(codec.encode(k, v, "fp8"))
    want = eager(codec.decode, eager(codec.encode, k, v, "fp8"))
    for g, w in zip(got, want):
        # which values are NaN is the same; the NaNs' sign and payload bits are torch's own
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[~g.isnan()], w[~w.isnan()])
    assert got[0][0, 0, :, 7].isnan().all() and got[0][0, 0, :, 6].isfinite().all()
    assert got[1][1, 0, 3].isnan().all() and got[1][1, 0, 2].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wide_head_and_a_long_slab_are_encoded_and_decoded_as_eager(native, dtype):
    """Scratch that grows with the input stays off the stack: per-channel scales of a head
    wider than the loops keep on the stack, and per-token scales of a slab of 3M tokens
    (12 MiB of them: a stack array that size ended the process)."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(1, 2, 8, 1500, generator=g).to(dtype)
    want = eager(codec.encode, wide, wide, "fp8")
    got = codec.encode(wide, wide, "fp8")
    assert bytes(got) == bytes(want)
    for a, b in zip(codec.decode(got), eager(codec.decode, want)):
        assert torch.equal(a, b)
    long = torch.randn(1, 1, 3 << 20, 2, generator=g).to(dtype)
    assert bytes(codec.encode(long, long, "fp8")) == bytes(eager(codec.encode, long, long, "fp8"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quotients_next_to_a_rounding_tie_are_the_eager_kernels_codes(native, dtype):
    """The loops skip the division (a reciprocal and two FMAs): values that land within a
    few ulps of a rounding boundary of the e4m3 grid, under scales that are not powers
    of two, where a plain reciprocal multiply picks the wrong code; odd head_dim too, so
    the vector loops' tails run."""
    g = torch.Generator().manual_seed(7)
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    marks = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # codes and the ties between them
    shape = (4, 3, 24, 72)
    amax = 1.0 + torch.rand(shape[0], shape[1], 1, 1, generator=g, dtype=torch.float64) * 30
    x = marks[torch.randint(len(marks), shape, generator=g)] * amax.float().double() / 448
    x = x.float()
    ulps = torch.randint(-2, 3, shape, generator=g, dtype=torch.int32)
    x = (x.view(torch.int32) + ulps * (x != 0)).view(torch.float32)
    x[..., 0, :] = amax.float()[..., 0, :]  # every row and column reaches its amax ...
    x[..., 0] = amax.float()[..., 0]
    x = torch.where(torch.rand(shape, generator=g) < 0.5, -x, x).to(dtype)  # ... either sign
    k, v = x, x.flip(2).contiguous()
    assert bytes(codec.encode(k, v, "fp8")) == bytes(eager(codec.encode, k, v, "fp8"))


def test_a_thread_that_flushes_subnormals_still_gets_exact_codes_and_values(native):
    """fp8's subnormals are float32 subnormals inside the loops (times 2^-120): a caller
    thread in flush-to-zero mode (``torch.set_flush_denormal``) must not change a byte."""
    k, v = hard_kv(torch.float32)
    want = codec.encode(k, v, "fp8")
    want_k, want_v = codec.decode(want)
    assert torch.set_flush_denormal(True)
    try:
        assert torch.tensor([1e-40]).mul(1.0).item() == 0.0  # this thread does flush
        got = codec.encode(k, v, "fp8")  # small: runs on this thread, no lanes
        got_k, got_v = codec.decode(want)
    finally:
        torch.set_flush_denormal(False)
    assert bytes(got) == bytes(want)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0  # the mode is the caller's again


def test_calls_hold_the_tensors_behind_their_addresses(native):
    """A call holds raw addresses, so it holds the tensors behind them too: a maker that
    drops its tensors before the calls run must not leave them pointing at freed memory."""

    def made():
        x, values = torch.randn(64, 64), torch.empty(64, 64)
        codes, scale = torch.empty(64, 64, dtype=torch.uint8), torch.empty(64)
        calls = fp8_cpu.encode_calls(x, codes, scale, per_token=True)
        calls += fp8_cpu.decode_calls(codes, scale, values, per_token=True)
        # two raw chunks of [1 head, 32 tokens, 64] into 4 blocks of 16 (K [D, N], V [N, D])
        k, v = torch.randn(2, 1, 32, 64), torch.randn(2, 1, 32, 64)
        cache = torch.zeros(4, 1, 16, 128)
        ptrs = torch.tensor([[k[j].data_ptr(), v[j].data_ptr()] for j in range(2)])
        offsets = torch.arange(4) * (16 * 128)
        geometry = (1, 32, 64, 16, 16 * 128, 1, 16, 16 * 64, 64, 1)
        calls += fp8_cpu.copy_blocks_calls(ptrs, offsets, cache, geometry)
        tensors = (x, values, codes, scale, ptrs, offsets, cache)
        return calls, [weakref.ref(t) for t in tensors], (k, v)

    calls, refs, (k, v) = made()
    gc.collect()
    assert all(r() is not None for r in refs)
    fp8_cpu.run(calls)
    cache = refs[-1]()
    block = cache.view(4, 16 * 128)  # each block: K as [64, 16], then V as [16, 64]
    assert torch.equal(block[1, 16 * 64 :].view(16, 64), v[0, 0, 16:])  # chunk 0's tokens 16-31
    assert torch.equal(block[2, : 16 * 64].view(64, 16), k[1, 0, :16].T)  # chunk 1's first
    del calls, cache, block
    gc.collect()
    assert all(r() is None for r in refs)  # and they go with the calls


def test_mismatched_buffers_are_refused_before_any_write(native):
    x = torch.randn(SHAPE)
    codes, scale = torch.zeros(SHAPE, dtype=torch.uint8), torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="sizes"):
        fp8_cpu.encode_into(x, codes, scale, per_token=False)  # per channel wants [3, 2, 64]
    with pytest.raises(ValueError, match="sizes"):
        fp8_cpu.decode_into(codes[:1], scale, torch.empty(SHAPE), per_token=True)
    assert not codes.any() and not scale.any()


def test_one_build_per_source_and_none_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    fp8_cpu._open()
    (built,) = (tmp_path / "cache").iterdir()
    stamp = built.stat().st_mtime_ns
    fp8_cpu._open()
    assert list((tmp_path / "cache").iterdir()) == [built]
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt

    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(fp8_cpu, "_state", {})
    with caplog.at_level(logging.WARNING, logger="kvstore.core.fp8_cpu"):
        assert fp8_cpu.load() is None
    assert "no C compiler" in caplog.text and os.environ["PATH"] == str(empty)
