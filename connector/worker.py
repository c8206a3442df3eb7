"""The worker half: moves chunks between the engine's paged KV cache and the store.

Offers ``WorkerHalf`` with ``register(kv_caches)``, ``load(meta)`` (before the
forward: synchronous, bounded by ``load_timeout_s``), ``save(meta)`` (after the
forward: copies the chunks out of the paged cache, then encodes and sends them
from a background thread through a bounded queue — when the queue is full the
chunk is skipped and counted, never waited for), ``load_errors()`` and
``close()``.

A load that fails or comes back short reports the blocks it could not fill, so
vLLM recomputes them; a chunk whose payload does not match the engine's
geometry is treated the same way. The engine never attends over unchecked KV.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from connector.config import ConnectorConfig
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore import codec
from kvstore.keys import Namespace, part_key
from kvstore.types import ChunkRecord

log = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class WorkerCounters:
    loaded_chunks: int = 0
    loaded_tokens: int = 0
    load_failures: int = 0
    saved_chunks: int = 0
    save_skipped: int = 0
    save_failures: int = 0


def _layer_order(name: str) -> tuple[int, str]:
    m = _LAYER_INDEX.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


class WorkerHalf:
    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        block_size: int,
        rank: int,
        layout_for: Callable[[torch.Tensor, str], object],
        *,
        client=None,
    ) -> None:
        self.config = config
        self.ns = namespace
        self.ns_digest = namespace.digest()
        self.block_size = block_size
        self.rank = rank
        self.tp = namespace.tp_size
        self.blocks_per_chunk = config.chunk_tokens // block_size
        self._layout_for = layout_for
        self._client = client
        self.counters = WorkerCounters()
        self._layers: list[torch.Tensor] = []
        self._layout = None
        self._errors: set[int] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=config.save_queue_depth)
        self._sender: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0

    @property
    def client(self):
        if self._client is None:
            from kvstore.client import ClientOptions, KVStoreClient

            opts = ClientOptions(timeout_s=self.config.load_timeout_s, retries=0)
            self._client = KVStoreClient(self.config.store, opts)
        return self._client

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        self._layers = [kv_caches[n] for n in names]
        if len(self._layers) != self.ns.num_layers:
            raise ValueError(
                f"engine has {len(self._layers)} KV cache layers, the namespace says "
                f"{self.ns.num_layers}"
            )
        self._layout = self._layout_for(self._layers[0], names[0])

    # ---- loading ---------------------------------------------------------------------

    def load(self, meta: KVStoreMetadata) -> None:
        for spec in meta.loads:
            self._load_one(spec)

    def _load_one(self, spec: LoadSpec) -> None:
        bpc = self.blocks_per_chunk
        keys = [part_key(k, self.rank, self.tp) for k in spec.keys]
        loaded = 0
        try:
            payloads = self.client.get(keys, timeout_s=self.config.load_timeout_s)
            for j, payload in enumerate(payloads[: len(keys)]):
                blocks = spec.block_ids[j * bpc : (j + 1) * bpc]
                self._write_chunk(payload, blocks, spec.first_block - j * bpc)
                loaded = j + 1
        except Exception as exc:  # the blocks below are recomputed; the engine goes on
            log.warning("kvstore load for %s stopped after %d chunks: %s", spec.req_id, loaded, exc)
        if loaded < len(keys):
            self.counters.load_failures += 1
            first_bad = max(loaded * bpc, spec.first_block)
            self._errors.update(spec.block_ids[first_bad:])
        self.counters.loaded_chunks += loaded
        self.counters.loaded_tokens += max(0, loaded * bpc - spec.first_block) * self.block_size

    def _write_chunk(self, payload, blocks: list[int], skip: int) -> None:
        k, v = codec.decode(payload)
        want = (self.ns.num_layers, self._heads(), self.config.chunk_tokens, self.ns.head_dim)
        if tuple(k.shape) != want:
            raise ValueError(f"chunk shape {tuple(k.shape)} does not match the engine's {want}")
        skip = max(0, skip)
        if skip >= len(blocks):
            return
        tokens = slice(skip * self.block_size, None)
        for layer, cache in enumerate(self._layers):
            kl = k[layer][:, tokens].to(cache.device, cache.dtype)
            vl = v[layer][:, tokens].to(cache.device, cache.dtype)
            self._layout.scatter(cache, blocks[skip:], kl, vl)

    def _heads(self) -> int:
        return self.ns.num_kv_heads // self.tp if self.ns.num_kv_heads >= self.tp else 1

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ---- saving ----------------------------------------------------------------------

    def save(self, meta: KVStoreMetadata) -> None:
        for spec in meta.saves:
            self._save_one(spec)

    def _save_one(self, spec: SaveSpec) -> None:
        bpc = self.blocks_per_chunk
        parent = spec.parent
        for j, key in enumerate(spec.keys):
            blocks = spec.block_ids[j * bpc : (j + 1) * bpc]
            if self._queue.full():
                # never stall the engine: later chunks of this chain lose their parent too
                skipped = len(spec.keys) - j
                if self.counters.save_skipped == 0:
                    log.warning(
                        "kvstore save queue full (save_queue_depth=%d): skipping chunks; "
                        "the store is slower than the engine",
                        self.config.save_queue_depth,
                    )
                self.counters.save_skipped += skipped
                return
            ks, vs = zip(*(self._layout.gather(cache, blocks) for cache in self._layers))
            # the copies above are the engine's data now; encoding can wait for the thread
            self._enqueue((key, parent, torch.stack(ks), torch.stack(vs)))
            parent = key

    def _enqueue(self, item) -> None:
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_loop, daemon=True, name="kvstore-save"
            )
            self._sender.start()
        with self._idle:
            self._pending += 1
        self._queue.put_nowait(item)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, parent, k, v = item
            try:
                payload = codec.encode(k, v, self.config.codec)
                rec = ChunkRecord(
                    part_key(key, self.rank, self.tp),
                    part_key(parent, self.rank, self.tp) if parent else None,
                    self.ns_digest,
                    payload,
                )
                result = self.client.put([rec], timeout_s=self.config.save_timeout_s)
                self.counters.saved_chunks += result.stored + result.duplicates
                if result.rejected:
                    self.counters.save_failures += len(result.rejected)
                    log.warning("kvstore refused a chunk: %s", result.rejected[0][1])
            except Exception as exc:
                self.counters.save_failures += 1
                log.warning("kvstore save failed (chunk dropped): %s", exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued saves were sent (tests and shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self.flush(self.config.save_timeout_s)
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=5)
        if self._client is not None:
            self._client.close()
