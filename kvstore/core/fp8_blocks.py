"""A load's fp8 chunks, checked but not decoded: each layer is decoded later straight into
an engine's paged cache (``Fp8Batch.into_blocks``), with no batch in between.

Offers ``Fp8Batch`` (built by ``codec.decode_many(..., defer_fp8=True)``) and
``DeferredChunk``, one chunk of it that decodes itself on first use, for the callers that
want a chunk's (K, V) after all (a chunk only partly loaded). Decoding into a batch first
and copying that into the cache cost a full write and read of the decoded bytes more than
a ``raw`` load, which is copied once.
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

    def __len__(self) -> int:
        return len(self.bodies)

    def __bool__(self) -> bool:  # a batch, even of no chunk, is not "no batch"
        return True

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
        _, heads, tokens, dim = self.shape
        if cache.dtype != self.dtype:
            raise ValueError(f"fp8 blocks: cache is {cache.dtype}, the chunks {self.dtype}")
        ptrs = self._base[first:last] + layer * self._step
        geometry = (heads, tokens, dim, *strides)
        fp8_cpu.run(fp8_cpu.decode_blocks_calls(ptrs, offsets, cache, geometry))


class DeferredChunk:
    """Chunk ``j`` of an ``Fp8Batch`` as a (K, V) pair, decoded on first use."""

    def __init__(self, batch: Fp8Batch, j: int) -> None:
        self._batch, self._j = batch, j
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def _get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = self._batch.chunk(self._j)
        return self._kv

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._get()[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._get())

    def __len__(self) -> int:
        return 2
