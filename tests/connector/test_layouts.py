"""Paged-cache layouts: vectorized gather/scatter agree with slow per-element references written
from vLLM's kernel addressing, round trips are bit-exact, and the right layout is chosen.

Needs only torch (vLLM itself is never imported here: detection is tested on its fallback).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from connector.layouts import (
    CpuLayout,
    FlashLayout,
    PagedLayout,
    cpu_layout_for_isa,
    detect_cpu_isa,
    detect_cpu_layout,
    kernel_block_ids,
    layout_for,
)

H, D, N, NUM_BLOCKS = 2, 32, 32, 6


# ---- slow references: one element at a time, addressing as vLLM's kernels do -----------------


def ref_cpu_write(kv, block_ids, k, v, amx):
    """Write K/V ``[H, T, D]`` into a CPU cache like ``reshape_and_cache`` (cpu_attn_*.hpp)."""
    _, heads, n, c = kv.shape
    d = c // 2
    for t in range(k.shape[1]):
        block, off = block_ids[t // n], t % n
        for h in range(heads):
            flat = kv[block, h].view(-1)  # the head's block: K in [0, n*d), V in [n*d, 2*n*d)
            for i in range(d):
                if amx:
                    # K: 16-token groups, dims packed in pairs (one 32-bit AMX element)
                    k_at = 2 * ((off // 16) * 16 * (d // 2) + (i // 2) * 16 + off % 16) + i % 2
                    # V: 16-dim groups, tokens packed in pairs
                    v_at = (i // 16) * n * 16 + (off // 2) * 32 + (i % 16) * 2 + off % 2
                else:
                    k_at = i * n + off  # column-major [D, N]
                    v_at = off * d + i  # row-major [N, D]
                flat[k_at] = k[h, t, i]
                flat[n * d + v_at] = v[h, t, i]


def ref_flash_write(kv, block_ids, k, v):
    _, heads, n, c = kv.shape
    d = c // 2
    for t in range(k.shape[1]):
        block, off = block_ids[t // n], t % n
        for h in range(heads):
            for i in range(d):
                kv[block, h, off, i] = k[h, t, i]
                kv[block, h, off, d + i] = v[h, t, i]


def counting_kv(tokens, dtype):
    """K/V of exactly representable integers, distinct within any window of ``modulus``."""
    n = H * tokens * D
    # bf16 holds integers exactly up to 256, fp16 up to 2048 (251 and 2039 are primes)
    modulus = {torch.bfloat16: 251, torch.float16: 2039}.get(dtype, n)
    base = torch.arange(n) % modulus - modulus // 2
    k = base.reshape(H, tokens, D).to(dtype)
    v = (-base - 1).reshape(H, tokens, D).to(dtype)
    return k, v


# ---- layouts under test ---------------------------------------------------------------------


def flash_nhd(dtype):
    """GPU cache with LBNHC strides (physical [B, N, H, 2D]) seen as logical [B, H, N, 2D]."""
    return torch.zeros(NUM_BLOCKS, N, H, 2 * D, dtype=dtype).transpose(1, 2)


def flash_hnd(dtype):
    return torch.zeros(NUM_BLOCKS, H, N, 2 * D, dtype=dtype)


CASES = {
    "cpu-vec-f32": (lambda: CpuLayout(N, D, amx=False), torch.float32, flash_hnd),
    "cpu-vec-bf16": (lambda: CpuLayout(N, D, amx=False), torch.bfloat16, flash_hnd),
    "cpu-vec-f16": (lambda: CpuLayout(N, D, amx=False), torch.float16, flash_hnd),
    "cpu-amx-bf16": (lambda: CpuLayout(N, D, amx=True), torch.bfloat16, flash_hnd),
    "cpu-amx-f16": (lambda: CpuLayout(N, D, amx=True), torch.float16, flash_hnd),
    "flash-hnd": (lambda: FlashLayout(N), torch.bfloat16, flash_hnd),
    "flash-nhd": (lambda: FlashLayout(N), torch.float32, flash_nhd),
}


def ref_write(layout, kv, block_ids, k, v):
    if isinstance(layout, CpuLayout):
        ref_cpu_write(kv, block_ids, k, v, layout.amx)
    else:
        ref_flash_write(kv, block_ids, k, v)


@pytest.fixture(params=list(CASES))
def case(request):
    make_layout, dtype, make_cache = CASES[request.param]
    return make_layout(), dtype, lambda: make_cache(dtype)


def test_layouts_satisfy_the_protocol(case):
    layout, _, _ = case
    assert isinstance(layout, PagedLayout)


def test_gather_reads_hand_placed_values_in_canonical_order(case):
    layout, dtype, new_cache = case
    blocks = [4, 0, 2]
    k, v = counting_kv(len(blocks) * N, dtype)
    kv = new_cache()
    ref_write(layout, kv, blocks, k, v)
    gk, gv = layout.gather(kv, blocks)
    assert gk.shape == (H, len(blocks) * N, D) and gk.dtype == dtype
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # any sub-order of blocks reads the matching token ranges
    gk, gv = layout.gather(kv, [2, 4])
    assert torch.equal(gk, torch.cat([k[:, 2 * N :], k[:, :N]], dim=1))
    assert torch.equal(gv, torch.cat([v[:, 2 * N :], v[:, :N]], dim=1))


def test_gather_into_a_chunk_s_stacked_layers_writes_only_its_own_layer(case):
    layout, dtype, new_cache = case
    blocks = [3, 1]
    k, v = counting_kv(len(blocks) * N, dtype)
    kv = new_cache()
    ref_write(layout, kv, blocks, k, v)
    shape = (3, H, len(blocks) * N, D)  # three layers, as a saved chunk stacks them
    ks, vs = torch.full(shape, 7, dtype=dtype), torch.full(shape, 7, dtype=dtype)
    got = layout.gather(kv, blocks, out=(ks[1], vs[1]))
    assert got[0].data_ptr() == ks[1].data_ptr()  # written in place, not copied again
    assert torch.equal(ks[1], k) and torch.equal(vs[1], v)
    assert bool((ks[0] == 7).all() and (ks[2] == 7).all() and (vs[2] == 7).all())
    with pytest.raises(ValueError, match="contiguous"):
        layout.gather(kv, blocks, out=(ks[1].transpose(0, 1), vs[1]))


def test_scatter_writes_what_the_kernel_would(case):
    layout, dtype, new_cache = case
    blocks = [1, 5]
    k, v = counting_kv(len(blocks) * N, dtype)
    want, got = new_cache(), new_cache()
    ref_write(layout, want, blocks, k, v)
    layout.scatter(got, blocks, k, v)
    assert torch.equal(got, want)


def test_gather_then_scatter_elsewhere_is_bit_exact(case):
    layout, dtype, new_cache = case
    src = new_cache()
    src.copy_(torch.randn(src.shape).to(dtype))
    k, v = layout.gather(src, [3, 1, 4])
    dst = new_cache()
    layout.scatter(dst, torch.tensor([0, 5, 2]), k, v)
    for a, b in ((3, 0), (1, 5), (4, 2)):
        assert torch.equal(dst[b], src[a])
    assert not dst[1].any() and not dst[3].any() and not dst[4].any()
    k2, v2 = layout.gather(dst, [0, 5, 2])
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_scatter_many_writes_what_one_scatter_of_the_whole_would(case):
    """A prefix's chunks scattered in one call: parts of 2, 1 and 2 blocks land exactly
    where one scatter of their concatenation puts them, and nothing else is touched."""
    layout, dtype, new_cache = case
    blocks = [4, 0, 3, 1, 5]
    k, v = counting_kv(len(blocks) * N, dtype)
    want, got = new_cache(), new_cache()
    layout.scatter(want, blocks, k, v)
    cuts = [0, 2 * N, 3 * N, 5 * N]
    parts = [(k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    layout.scatter_many(got, torch.tensor(blocks), parts)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not fill"):
        layout.scatter_many(new_cache(), blocks, parts[:2])
    with pytest.raises(ValueError, match="do not fill"):
        layout.scatter_many(new_cache(), blocks[:2], [(k[:, : N + 1], v[:, : N + 1])] * 2)


def test_scatter_many_takes_stacked_chunks_as_one_part(case):
    """Chunks of 2 blocks stacked ``[chunks, H, T, D]`` (strided over chunks, as views of a
    load's staging buffer are) after a part of one block: the same as one scatter."""
    layout, dtype, new_cache = case
    blocks = [4, 0, 3, 1, 5]
    k, v = counting_kv(len(blocks) * N, dtype)
    want, got = new_cache(), new_cache()
    layout.scatter(want, blocks, k, v)
    room = torch.zeros(2, 3, H, 2 * N, D, dtype=dtype)  # K, a gap, V per chunk
    for j in range(2):
        room[j, 0] = k[:, N + 2 * N * j : 3 * N + 2 * N * j]
        room[j, 2] = v[:, N + 2 * N * j : 3 * N + 2 * N * j]
    stacked = (room[:, 0], room[:, 2])
    assert not stacked[0].is_contiguous()
    layout.scatter_many(got, blocks, [(k[:, :N], v[:, :N]), stacked])
    assert torch.equal(got, want)
    narrow = (room[:, 0, :, :, : D // 2], room[:, 2, :, :, : D // 2])
    with pytest.raises(ValueError, match="stacked K/V must be"):
        layout.scatter_many(new_cache(), blocks[1:], [narrow])


def test_gather_returns_a_copy_and_empty_ids_are_fine(case):
    layout, dtype, new_cache = case
    kv = new_cache()
    k, v = layout.gather(kv, [0])
    k.fill_(1)
    v.fill_(1)
    assert not kv.any()  # the engine's cache is never aliased by what we hand out
    k0, v0 = layout.gather(kv, [])
    assert k0.shape == (H, 0, D)
    layout.scatter(kv, [], k0, v0)
    assert not kv.any()


def test_amx_and_vec_layouts_differ():
    # guards the tests above: a layout mix-up must not go unnoticed
    k, v = counting_kv(N, torch.bfloat16)
    kv = torch.zeros(2, H, N, 2 * D, dtype=torch.bfloat16)
    CpuLayout(N, D, amx=True).scatter(kv, [1], k, v)
    gk, gv = CpuLayout(N, D, amx=False).gather(kv, [1])
    assert not torch.equal(gk, k) and not torch.equal(gv, v)


@pytest.mark.parametrize("amx", [False, True])
def test_cpu_layouts_with_other_geometry(amx):
    n, d, heads = 64, 64, 3
    layout = CpuLayout(n, d, amx=amx)
    src = torch.randn(4, heads, n, 2 * d).bfloat16()
    k, v = layout.gather(src, [2, 0])
    assert k.shape == (heads, 2 * n, d)
    want = torch.zeros_like(src)
    ref_cpu_write(want, [3, 1], k, v, amx)
    got = torch.zeros_like(src)
    layout.scatter(got, [3, 1], k, v)
    assert torch.equal(got, want) and torch.equal(got[3], src[2]) and torch.equal(got[1], src[0])


def test_manager_blocks_split_into_kernel_blocks():
    # vLLM may view a 64-token manager block as two 32-token kernel blocks 2b, 2b + 1
    kv = torch.randn(8, H, N, 2 * D)
    assert kernel_block_ids(kv, [3, 1], 2 * N).tolist() == [6, 7, 2, 3]
    layout = CpuLayout(2 * N, D)
    k, v = layout.gather(kv, [3])
    k_kernel, v_kernel = CpuLayout(N, D).gather(kv, [6, 7])
    assert k.shape == (H, 2 * N, D) and torch.equal(k, k_kernel) and torch.equal(v, v_kernel)
    with pytest.raises(ValueError, match="multiple"):
        kernel_block_ids(kv, [0], N + 16)


def test_bad_input_is_refused():
    layout = CpuLayout(N, D)
    kv = torch.zeros(NUM_BLOCKS, H, N, 2 * D)
    with pytest.raises(IndexError):
        layout.gather(kv, [NUM_BLOCKS])
    with pytest.raises(IndexError):
        layout.gather(kv, torch.tensor([-1]))
    k = torch.zeros(H, N, D)
    with pytest.raises(ValueError, match="kv_heads, tokens, head_dim"):
        layout.scatter(kv, [0, 1], k, k)
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        CpuLayout(N, 64).gather(kv, [0])
    with pytest.raises(ValueError, match="block_size"):
        CpuLayout(16, D)
    with pytest.raises(ValueError, match="2-byte"):
        CpuLayout(N, D, amx=True).gather(kv, [0])
    with pytest.raises(ValueError, match="0.32"):
        FlashLayout(N).gather(torch.zeros(2, NUM_BLOCKS, N, H, D), [0])
    assert not kv.any()


def test_scatter_casts_to_the_cache_dtype():
    kv = torch.zeros(2, H, N, 2 * D, dtype=torch.bfloat16)
    k, v = counting_kv(N, torch.float32)
    FlashLayout(N).scatter(kv, [1], k, v)
    gk, _ = FlashLayout(N).gather(kv, [1])
    assert gk.dtype == torch.bfloat16 and torch.equal(gk, k.bfloat16())


# ---- canonical chunks -------------------------------------------------------------------------


def stacked(per_layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer ``(k, v)`` of ``[H, T, D]`` as one chunk's ``[L, H, T, D]`` K and V."""
    ks, vs = zip(*per_layer)
    return torch.stack(ks), torch.stack(vs)


def test_chunk_round_trip_through_the_codec_between_layouts():
    """Saved from a CPU engine (vec), loaded into an AMX one and a GPU-style one: same K/V."""
    codec = pytest.importorskip("kvstore.core.codec")
    src = [torch.randn(NUM_BLOCKS, H, N, 2 * D).bfloat16() for _ in range(2)]
    vec = CpuLayout(N, D)
    k, v = stacked([vec.gather(layer, [2, 5]) for layer in src])
    k, v = codec.decode(codec.encode(k, v, "raw"))
    for layout in (CpuLayout(N, D, amx=True), FlashLayout(N)):
        dst = [torch.zeros(NUM_BLOCKS, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(2)]
        for layer, kl, vl in zip(dst, k, v):
            layout.scatter(layer, [0, 3], kl, vl)
        back = stacked([layout.gather(layer, [0, 3]) for layer in dst])
        assert torch.equal(back[0], k) and torch.equal(back[1], v)


# ---- choosing a layout ------------------------------------------------------------------------


@pytest.fixture
def no_vllm(monkeypatch):
    # a None entry makes the import fail: detection runs on its own copy of vLLM's rules
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", None)


def fake_config(dtype=torch.bfloat16, block_size=32, head_dim=D, cache_dtype="auto", isa=None):
    layer = SimpleNamespace(isa=isa) if isa else SimpleNamespace()
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: head_dim),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(static_forward_context={"l.0.attn": layer}),
    )


def test_fallback_isa_follows_vllm_rules(no_vllm, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert detect_cpu_isa(torch.bfloat16, 32, 64) == "amx"
    assert detect_cpu_isa(torch.float16, 32, 64) == "vec"
    assert detect_cpu_isa(torch.float32, 32, 64) == "vec"
    assert detect_cpu_isa(torch.bfloat16, 32, 80) == "vec16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert detect_cpu_isa(torch.bfloat16, 32, 64) == "vec"
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert detect_cpu_isa(torch.float16, 32, 64) == "neon"


def test_isa_to_layout():
    assert cpu_layout_for_isa("amx", torch.bfloat16, 32, 64).amx
    for isa in ("vec", "vec16", "neon"):
        assert not cpu_layout_for_isa(isa, torch.float32, 32, 64).amx
    for isa, dtype in (("neon", torch.bfloat16), ("vsx", torch.float32), ("amx", torch.float16)):
        with pytest.raises(NotImplementedError):
            cpu_layout_for_isa(isa, dtype, 32, 64)


def test_detect_cpu_layout_prefers_the_engines_recorded_isa(no_vllm, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert not detect_cpu_layout(fake_config()).amx
    layout = detect_cpu_layout(fake_config(isa="amx"), layer_name="l.0.attn")
    assert layout.amx and layout.block_size == 32 and layout.head_dim == D
    # explicit values win over the config
    assert detect_cpu_layout(fake_config(), block_size=64).block_size == 64
    with pytest.raises(NotImplementedError, match="fp8"):
        detect_cpu_layout(fake_config(cache_dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match="need dtype"):
        detect_cpu_layout(dtype=torch.float32, block_size=32)


def test_layout_for_picks_by_device(no_vllm, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    kv = torch.zeros(4, H, N, 2 * D)
    layout = layout_for(kv)
    assert isinstance(layout, CpuLayout) and (layout.block_size, layout.head_dim) == (N, D)
    assert isinstance(layout_for(kv, fake_config(dtype=torch.float32)), CpuLayout)
    meta = torch.zeros(4, H, N, 2 * D, device="meta")
    layout = layout_for(meta, fake_config(block_size=64))
    assert isinstance(layout, FlashLayout) and layout.block_size == 64
