"""A load's chunks written straight into a CPU cache's blocks, with no batch and no staging
copy (``CpuLayout.write_fp8`` decodes fp8 chunks, ``write_raw`` copies raw ones): exactly
what decoding each chunk and scattering it writes, no other block touched, and what they
cannot place refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from connector.layouts import CpuLayout
from kvstore.core import codec, fp8_cpu

pytestmark = pytest.mark.skipif(fp8_cpu.load() is None, reason="no C compiler here")

LAYERS, H, T, D, N, BLOCKS = 2, 2, 64, 32, 32, 12


def use_native(monkeypatch, shape, dtype=torch.float32):
    """The codec on its C loops for chunks of ``shape``, undone after the test."""
    monkeypatch.setattr(codec._Kernels, "native", codec._Kernels.native)
    assert codec.compile_kernels(shape, dtype)
    assert codec._Kernels.native


@pytest.fixture
def native(monkeypatch):
    use_native(monkeypatch, (LAYERS, H, T, D))


def payloads(dtype, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        k = torch.randn(LAYERS, H, T, D, generator=g) * torch.exp2(torch.randn(D, generator=g) * 4)
        v = torch.randn(LAYERS, H, T, D, generator=g)
        out.append(codec.encode(k.to(dtype), v.to(dtype), "fp8"))
    return out


def cache(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, H, N, 2 * D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_layer_lands_as_decoding_and_scattering_each_chunk_would(native, dtype):
    layout = CpuLayout(N, D)
    chunks = payloads(dtype, 3)
    got, error = codec.decode_many(chunks, defer_fp8=True)
    assert error is None and isinstance(got.stacked, codec.Fp8Batch)
    assert got.shape == (LAYERS, H, T, D)
    blocks = [9, 2, 7, 0]  # chunks 1 and 2, two blocks each, out of order
    want, have = cache(dtype), cache(dtype)
    for layer in range(LAYERS):
        assert layout.write_fp8(have, blocks, got.stacked, layer, 1, 3)
        for j in (1, 2):
            k, v = codec.decode(chunks[j])
            layout.scatter(want, blocks[2 * (j - 1) : 2 * j], k[layer], v[layer])
        assert torch.equal(have, want), f"layer {layer}"  # every other block untouched too
    # a chunk asked for whole (a load cut inside it) decodes on its own, as decode does
    k0, v0 = got[0]
    assert torch.equal(k0, codec.decode(chunks[0])[0]) and torch.equal(
        v0, codec.decode(chunks[0])[1]
    )


def test_what_cannot_be_placed_is_refused_before_any_write(native):
    layout = CpuLayout(N, D)
    got, _ = codec.decode_many(payloads(torch.float32, 2), defer_fp8=True)
    batch, untouched = got.stacked, cache(torch.float32)
    kv = cache(torch.float32)
    # AMX packing is not strided; a cache of another dtype; a transposed (non-contiguous) view
    assert not CpuLayout(N, D, amx=True).write_fp8(kv, [0, 1], batch, 0, 0, 1)
    assert not layout.write_fp8(kv.to(torch.bfloat16), [0, 1], batch, 0, 0, 1)
    assert not layout.write_fp8(
        kv.transpose(0, 1).contiguous().transpose(0, 1), [0, 1], batch, 0, 0, 1
    )
    with pytest.raises(ValueError, match="do not fill"):
        layout.write_fp8(kv, [0, 1, 2], batch, 0, 0, 1)
    with pytest.raises(IndexError):
        layout.write_fp8(kv, [0, BLOCKS], batch, 0, 0, 1)
    strides = layout.direct_strides(kv)
    block = H * N * 2 * D
    with pytest.raises(ValueError, match="only blocks of K"):  # K [N, D]: not vLLM's order
        batch.into_blocks(0, 0, 1, kv, torch.tensor([0, block]), (N, N * 2 * D, D, 1, N * D, D, 1))
    with pytest.raises(ValueError, match="no layer"):  # nothing read outside the chunks
        batch.into_blocks(LAYERS, 0, 1, kv, torch.tensor([0, block]), strides)
    with pytest.raises(ValueError, match="no layer"):
        batch.into_blocks(0, 1, 3, kv, torch.tensor([0, block, 2 * block, 3 * block]), strides)
    with pytest.raises(ValueError, match="outside the cache"):  # the last block runs off the end
        batch.into_blocks(0, 0, 1, kv, torch.tensor([0, BLOCKS * block - 1]), strides)
    with pytest.raises(ValueError, match="outside the cache"):
        batch.into_blocks(0, 0, 1, kv, torch.tensor([-block, 0]), strides)
    assert torch.equal(kv, untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_chunks_lying_a_payload_apart_land_as_scatter_puts_them(dtype):
    """Chunks as a same-host load sees them: ``[chunks, L, H, T, D]`` views one payload
    apart (a header and a gap between chunks), one layer written with one call."""
    layout = CpuLayout(N, D)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(3, LAYERS, H, T, D, generator=g).to(dtype) for _ in range(2))
    stride = 2 * LAYERS * H * T * D + 64  # a payload's stride, larger than its K and V
    flat = torch.zeros(3 * stride, dtype=dtype)
    for j in range(3):
        flat[j * stride : j * stride + LAYERS * H * T * D] = k[j].reshape(-1)
        flat[j * stride + LAYERS * H * T * D : j * stride + 2 * LAYERS * H * T * D] = v[j].reshape(
            -1
        )
    shape, strides = (3, LAYERS, H, T, D), (stride, H * T * D, T * D, D, 1)
    ks = flat.as_strided(shape, strides, 0)
    vs = flat.as_strided(shape, strides, LAYERS * H * T * D)
    assert not ks.is_contiguous()
    blocks = [5, 1, 10, 3, 8, 0]
    for layer in range(LAYERS):
        want, have = cache(dtype), cache(dtype)
        assert layout.write_raw(have, blocks, ks[:, layer], vs[:, layer])
        layout.scatter_many(want, blocks, [(ks[:, layer], vs[:, layer])])
        assert torch.equal(have, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 12, 136])  # K turned in 8 x 8 tiles, or value by value
def test_raw_chunks_of_any_head_dim_land_as_scatter_puts_them(dtype, dim):
    layout = CpuLayout(N, dim)
    g = torch.Generator().manual_seed(dim)
    k, v = (torch.randn(3, H, T, dim, generator=g).to(dtype) for _ in range(2))
    want = torch.randn(BLOCKS, H, N, 2 * dim, generator=g).to(dtype)
    have = want.clone()
    blocks = [7, 2, 11, 0, 9, 4]
    assert layout.write_raw(have, blocks, k, v)
    layout.scatter_many(want, blocks, [(k, v)])
    assert torch.equal(have, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 12, 136])  # K decoded into 8 x 8 tiles, or value by value
def test_fp8_chunks_of_any_head_dim_land_as_decode_and_scatter_put_them(monkeypatch, dtype, dim):
    use_native(monkeypatch, (LAYERS, H, T, dim), dtype)
    layout = CpuLayout(N, dim)
    g = torch.Generator().manual_seed(dim)
    chunks = []
    for j in range(2):
        k = torch.randn(LAYERS, H, T, dim, generator=g) * torch.exp2(torch.randn(dim, generator=g))
        v = torch.randn(LAYERS, H, T, dim, generator=g)
        if j == 0:  # layer 0: channel 0's scale past 2^7 (not folded); layer 1: NaN scales
            k[0, ..., 0] = (torch.rand(H, T, generator=g) * 2 - 1) * 6e4
            k[0, 0, 0, 0] = 6e4  # under float16's largest
            k[1, 0, 3, 1], v[1, 0, 5, 2] = float("nan"), float("nan")
        chunks.append(codec.encode(k.to(dtype), v.to(dtype), "fp8"))
    got, error = codec.decode_many(chunks, defer_fp8=True)
    assert error is None and isinstance(got.stacked, codec.Fp8Batch)
    want = torch.randn(BLOCKS, H, N, 2 * dim, generator=g).to(dtype)
    have = want.clone()
    blocks = [7, 2, 11, 0]
    for layer in range(LAYERS):
        assert layout.write_fp8(have, blocks, got.stacked, layer, 0, 2)
        for j in range(2):
            k, v = codec.decode(chunks[j])
            layout.scatter(want, blocks[2 * j : 2 * j + 2], k[layer], v[layer])
        bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaNs compared too
        assert torch.equal(have.view(bits), want.view(bits)), f"layer {layer}"
    assert have.isnan().any()  # the NaN case was written


def test_raw_parts_that_cannot_be_copied_so_are_left_to_scatter_many():
    layout = CpuLayout(N, D)
    k = torch.randn(2, H, T, D)
    kv, untouched = cache(torch.float32), cache(torch.float32)
    assert not CpuLayout(N, D, amx=True).write_raw(
        kv.bfloat16(), [0, 1, 2, 3], k.bfloat16(), k.bfloat16()
    )
    assert not layout.write_raw(kv, [0, 1, 2, 3], k.double(), k.double())  # another dtype
    assert not layout.write_raw(kv, [0, 1, 2, 3], k.transpose(2, 3).contiguous().transpose(2, 3), k)
    with pytest.raises(ValueError, match="do not fill"):
        layout.write_raw(kv, [0, 1, 2], k, k)
    assert torch.equal(kv, untouched)
