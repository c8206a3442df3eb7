"""A load's chunks written straight into an engine's paged CPU cache, a layer at a time.

Offers ``Fp8Batch`` (built by ``codec.decode_many(..., defer_fp8=True)``: fp8 chunks,
checked but not decoded, each layer decoded later straight into the blocks by
``into_blocks``), ``DeferredChunk`` (one chunk's (K, V), made on first use: of an
``Fp8Batch``, or a raw chunk's views, for callers that want a chunk after all, such as a
chunk only partly loaded) and
``raw_into_blocks`` (raw chunks copied so). Decoding into a batch first, or staging the
blocks in engine order and then copying them in with one indexed copy, cost a full
write and read of the bytes more than this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvstore.core import fp8_cpu


class Fp8Batch:
    """Chunks of one shape ``(L, H, T, D)`` and source dtype, as fp8 bodies (uint8 tensors:
    K codes, V codes, K scales per channel, V scales per token) that outlive this object's
    use; ``decode_one(j)`` decodes chunk ``j`` whole."""

    def __init__(
        self,
        bodies: list[torch.Tensor],
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        decode_one: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.bodies, self.shape, self.dtype = bodies, shape, dtype
        self._decode_one = decode_one
        layers, heads, tokens, dim = shape
        n = layers * heads * tokens * dim
        starts = torch.tensor([b.data_ptr() for b in bodies], dtype=torch.int64)[:, None]
        # per chunk: K codes, V codes, K scales, V scales of layer 0; layer l is + l * step
        self._base = starts + torch.tensor([0, n, 2 * n, 2 * n + 4 * layers * heads * dim])
        hd = heads * dim
        self._step = torch.tensor([hd * tokens, hd * tokens, 4 * hd, 4 * heads * tokens])

    def chunk(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode_one(j)

    def into_blocks(
        self,
        layer: int,
        first: int,
        last: int,
        cache: torch.Tensor,
        offsets: torch.Tensor,
        strides: tuple[int, ...],
    ) -> None:
        """Layer ``layer`` of chunks ``[first, last)`` into ``cache`` (CPU, contiguous, of the
        chunks' dtype): ``offsets`` (int64) the first element of each of their blocks of
        ``N`` tokens, in order; ``strides`` = (N, head stride, K token and dim strides, V
        offset, V token and dim strides) in elements (``CpuLayout.direct_strides``)."""
        layers, heads, tokens, dim = self.shape
        if cache.dtype != self.dtype:
            raise ValueError(f"fp8 blocks: cache is {cache.dtype}, the chunks {self.dtype}")
        if not (0 <= layer < layers and 0 <= first <= last <= len(self.bodies)):
            raise ValueError(f"fp8 blocks: no layer {layer} of chunks [{first}, {last})")
        ptrs = self._base[first:last] + layer * self._step
        geometry = (heads, tokens, dim, *strides)
        fp8_cpu.run(fp8_cpu.decode_blocks_calls(ptrs, offsets, cache, geometry))


class DeferredChunk:
    """A chunk's (K, V) pair, made by ``make()`` on first use."""

    __slots__ = ("_make", "_kv")

    def __init__(self, make: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._make = make
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def _get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = self._make()
        return self._kv

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._get()[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._get())

    def __len__(self) -> int:
        return 2


def raw_into_blocks(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    offsets: torch.Tensor,
    strides: tuple[int, ...],
) -> bool:
    """One layer of raw chunks, K and V ``[chunks, H, T, D]`` (each chunk's ``[H, T, D]``
    contiguous, of the cache's dtype, on the CPU), copied into the blocks of ``cache`` as
    ``Fp8Batch.into_blocks`` places them; False, writing nothing, where they are not so."""
    m, heads, tokens, dim = k.shape
    inner = (tokens * dim, dim, 1)
    for x in (k, v):
        if x.shape != k.shape or x.dtype != cache.dtype or x.device.type != "cpu":
            return False
        if m and tuple(x.stride()[1:]) != inner:
            return False
    size = k.element_size()
    rows = torch.arange(m, dtype=torch.int64)
    ptrs = torch.stack(
        [k.data_ptr() + rows * k.stride(0) * size, v.data_ptr() + rows * v.stride(0) * size], dim=1
    )
    fp8_cpu.run(fp8_cpu.copy_blocks_calls(ptrs, offsets, cache, (heads, tokens, dim, *strides)))
    return True
