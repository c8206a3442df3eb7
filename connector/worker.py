"""The worker half: moves chunks between the engine's paged KV cache and the store.

Offers ``WorkerHalf`` with ``register(kv_caches)``, ``load(meta)`` (before the
forward: synchronous, bounded by ``load_timeout_s``; on the store's host through its
shared memory, ``ConnectorConfig.transport``; with ``load_layerwise`` a loader thread
writes the step's loads a layer at a time while the forward runs, and
``wait_for_layer(name)`` holds each attention layer until its layer is in; background
loads go to a loader thread and are reported by ``loads_done()``), ``save(meta)``
(after the forward: copies the chunks out of the paged cache, then encodes and sends
them from a background thread), ``finished(req_ids)``, ``load_errors()`` and
``close()``.

A load that fails or comes back short reports the blocks it could not fill, so
vLLM recomputes them (a background load's in the same pass that reports it done);
a chunk whose payload does not match the engine's geometry is treated the same
way. The engine never attends over unchecked KV: a whole load's checksums are checked
on a thread of their own while its blocks are written, and the load settles (reporting
the blocks of a chunk that failed) before the forward runs or the load is reported done.

Saving never raises into the engine and never waits for the store: each step's
chunks go to the sender as one item, bounded by ``save_queue_depth`` steps and
``save_queue_bytes`` of copied KV. A chunk that does not fit, fails to copy,
or fails to send ends its request's chain there: none of that request's later
chunks is sent (the store would refuse them as orphans). Everything is counted
in ``counters``; each kind of error is logged once.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from connector.config import ConnectorConfig
from connector.layer_loads import LayerLoads
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from connector.planner import MIN_STEP_TOKENS
from kvstore.client.grpc_client import ShmViews
from kvstore.client.shards import ShardedClient, connect
from kvstore.client.shm_writer import Fill, payload_bytes
from kvstore.core import bulk_copy, codec
from kvstore.core.fp8_blocks import Fp8Batch
from kvstore.core.keys import Namespace, part_key
from kvstore.core.payload import expected_body_len
from kvstore.core.types import ChunkRecord, ShmGrant

log = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
SPARE_CHUNKS = 4  # CPU K/V kept for the next gathers (4 x 32 MiB at Llama-3-8B bf16)


@dataclass
class WorkerCounters:
    loaded_chunks: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0  # from asking the store to the last block written
    load_fetch_seconds: float = 0.0  # of which getting the bytes (shared memory or gRPC)
    load_decode_seconds: float = 0.0  # of which decoding them (the rest: into the blocks)
    load_failures: int = 0
    granted_loads: int = 0  # read under the scheduler's lookup's shm handles (no GetShm)
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0  # encoding and sending (the background thread; never waited for)
    save_skipped: int = 0  # chunks not sent: queue full, or their chain had ended before
    save_failures: int = 0  # chunks that failed to copy, encode or send, or were refused
    chains_ended: int = 0  # requests whose chain ended before its last chunk
    timed_tokens: int = 0  # tokens of the forwards timed for the load planner
    timed_seconds: float = 0.0  # their time, metadata bound (forward starts) to wait_for_save
    layerwise_loads: int = 0  # steps whose loads were written a layer at a time
    layer_waits: int = 0  # attention layers that asked for their layer of those loads
    layer_wait_seconds: float = 0.0  # the forward's waits for those layers, all together


@dataclass
class _Plan:
    """Where a load's chunks go, the same for every layer (``WorkerHalf._scatter_plan``)."""

    ids: list[int]  # cache blocks
    cuts: list[tuple[int, slice]]  # chunk, tokens: written one by one
    whole: tuple[int, int] | None  # chunks [first, last) taken whole from the stacked batch


@dataclass
class _Fetched:
    """A load's chunks, fetched and decoded, and where they go in the cache."""

    spec: LoadSpec
    decoded: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    started: float
    plan: _Plan
    stacked: tuple[torch.Tensor, torch.Tensor] | None  # all chunks' K, V [n, L, H, T, D]
    written: bool = True  # False once writing a layer failed: no block of it is trusted
    views: ShmViews | None = None  # read in place under this lease, ended in _settle
    # the checksums, checked while the blocks are written: how many leading chunks hold
    checks: Future | None = None


@dataclass
class _Chunk:
    req_id: str
    key: bytes
    parent: bytes | None
    k: torch.Tensor
    v: torch.Tensor
    root: bytes  # the chain's first key: places it on a shard


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
        self._defer_fp8 = False  # set by register
        self._staging: dict[object, torch.Tensor] = {}  # same-host loads land here, per slot
        self._check_pool: ThreadPoolExecutor | None = None  # a load's checksums, while it writes
        self._layer_index: dict[str, int] = {}
        self._layerwise = False
        self._layer_jobs: queue.Queue | None = None  # (LayerLoads, specs) for the layer thread
        self._layer_job: LayerLoads | None = None  # this step's
        self._errors: set[int] = set()
        self._loader: queue.Queue | None = None  # background loads, in order
        self._loaded: list[tuple[str, set[int]]] = []  # done: request, blocks not filled
        self._loaded_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=config.save_queue_depth)
        # CPU K/V of chunks the sender is done with, for the next gathers: fresh ones
        # page-fault on the engine's thread (a Llama-3-8B bf16 chunk: 4,002 faults, and
        # 14.1 / 26.8 -> 9.2 / 7.4 ms to gather reused; benchmarks/save_path.py)
        self._spare: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque(
            maxlen=SPARE_CHUNKS
        )
        self._sender: threading.Thread | None = None
        self._idle = threading.Condition()  # guards the fields below and the save counters
        self._pending = 0  # steps queued or being sent
        self._queued_bytes = 0
        self._ended: set[str] = set()  # requests whose chain ended: gather nothing more
        self._send_failed: set[str] = set()  # the sender's own: drop their queued chunks too
        self._logged: set[str] = set()
        self._step: tuple[float, int] | None = None  # the forward being timed: start, tokens

    @property
    def client(self):
        if self._client is None:
            opts = self.config.client_options(self.config.load_timeout_s)
            self._client = connect(self.config.store, opts)
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
        # fp8 loads decode each layer straight into the blocks where the layout can take
        # them so (a contiguous CPU cache in the non-AMX order): no batch, no staging copy
        direct = getattr(self._layout, "direct_strides", lambda _: None)
        self._defer_fp8 = self.config.codec == "fp8" and all(
            direct(cache) is not None for cache in self._layers
        )
        self._layer_index = {n: i for i, n in enumerate(names)}
        # not on a GPU yet: the copies would need ordering against the engine's stream
        # (blocks it zeroes before the loads), and no test here can run that
        self._layerwise = self.config.load_layerwise and not self._layers[0].is_cuda
        if self.config.codec == "fp8" and self.config.compile_codec:
            shape = (self.ns.num_layers, self._heads(), self.config.chunk_tokens, self.ns.head_dim)
            cache = self._layers[0]
            codec.compile_kernels(shape, cache.dtype, cache.device)  # eager if this fails
        if self.config.same_host:
            bulk_copy.load()  # the same-host saves' copy, built now (~0.5 s once per host)

    # ---- timing forwards for the load planner ----------------------------------------

    def step_started(self, meta: KVStoreMetadata) -> None:
        """A forward of ``meta.scheduled_tokens`` begins: timed if it is mostly prefill and
        loads nothing (a load's time is the load's). Not on a GPU: its kernels run after
        the forward returns, so a wall clock here would say nothing about compute."""
        cpu = bool(self._layers) and not self._layers[0].is_cuda
        timed = cpu and meta.scheduled_tokens >= MIN_STEP_TOKENS and not meta.loads
        self._step = (time.perf_counter(), meta.scheduled_tokens) if timed else None

    def step_ended(self) -> None:
        if self._step is not None:
            started, tokens = self._step
            self._step = None
            self._count("timed_seconds", time.perf_counter() - started)
            self._count("timed_tokens", tokens)

    # ---- loading ---------------------------------------------------------------------

    def load(self, meta: KVStoreMetadata) -> None:
        now = [spec for spec in meta.loads if not spec.background]
        for spec in meta.loads:
            if spec.background:
                self._load_in_background(spec)
        if now and self._layerwise:
            self._load_by_layer(now)
            return
        for slot, spec in enumerate(now):
            self._errors.update(self._load_checked(spec, slot))

    def _load_checked(self, spec: LoadSpec, slot: object) -> set[int]:
        """Blocks of ``spec`` that could not be filled.

        The chunks' checksums are checked on a thread of their own while the blocks are
        written (the request's own blocks: nothing reads them before ``_settle`` says
        which hold checked bytes); a layer-wise load checks first, since each layer is
        read by the forward as soon as it is written."""
        try:
            fetched = self._fetch_decoded(spec, slot, check_later=True)
            for layer in range(len(self._layers)):
                self._write_layer(fetched, layer)
            return self._settle(fetched)
        except Exception as exc:  # unreachable by design; still never the engine's problem
            self._log_once("load", "kvstore load for %s failed: %r", spec.req_id, exc)
            return set(spec.block_ids[spec.first_block :])

    def _load_in_background(self, spec: LoadSpec) -> None:
        if self._loader is None:
            self._loader = queue.Queue()
            threading.Thread(target=self._load_loop, daemon=True, name="kvstore-load").start()
        self._loader.put(spec)

    def _load_loop(self) -> None:
        while True:
            spec = self._loader.get()
            if spec is None:
                return
            bad = self._load_checked(spec, "background")
            if self._layers and self._layers[0].is_cuda:
                torch.cuda.synchronize(self._layers[0].device)  # the copies have landed
            with self._loaded_lock:
                self._loaded.append((spec.req_id, bad))

    def loads_done(self) -> set[str]:
        """Requests whose background load ended since the last call; the blocks it could
        not fill are in the next ``load_errors()`` (vLLM asks for both in one pass)."""
        with self._loaded_lock:
            done, self._loaded = self._loaded, []
        for _, bad in done:
            self._errors.update(bad)
        return {req_id for req_id, _ in done}

    # ---- layer by layer (load_layerwise) ---------------------------------------------

    def _load_by_layer(self, specs: list[LoadSpec]) -> None:
        self._finish_layer_loads()  # a step's job ends in that step; this is a safety net
        blocks = [b for spec in specs for b in spec.block_ids[spec.first_block :]]
        job = LayerLoads(len(self._layers), blocks)
        if self._layer_jobs is None:
            self._layer_jobs = queue.Queue()
            threading.Thread(target=self._layer_loop, daemon=True, name="kvstore-layers").start()
        self._layer_job = job
        self._count("layerwise_loads", 1)
        self._layer_jobs.put((job, specs))

    def _layer_loop(self) -> None:
        while True:
            item = self._layer_jobs.get()
            if item is None:
                return
            job, specs = item
            fetched: list[_Fetched] = []
            try:
                fetched = [self._fetch_decoded(spec, slot) for slot, spec in enumerate(specs)]
                if job.write(functools.partial(self._write_layers, fetched)):
                    for f in fetched:
                        job.fail(self._settle(f))
            except Exception as exc:  # unreachable by design; the blocks are recomputed
                self._log_once("load", "kvstore layer-wise load failed: %r", exc)
                job.fail(job.blocks)
            finally:
                for f in fetched:  # a cancelled job's leases end too
                    if f.views is not None:
                        f.views.end()
                job.finish()

    def _write_layers(self, fetched: list[_Fetched], layer: int) -> None:
        for f in fetched:
            self._write_layer(f, layer)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: until the step's loads wrote its layer."""
        job = self._layer_job  # None unless this step loads layer by layer
        index = self._layer_index.get(layer_name) if job is not None else None
        if index is None:
            return
        t0 = time.perf_counter()
        job.wait(index + 1, self._layer_wait_s())
        self._count("layer_wait_seconds", time.perf_counter() - t0)
        self._count("layer_waits", 1)

    def _finish_layer_loads(self) -> None:
        """End the step's layer-wise job (every layer written, or cancelled) and take the
        blocks it could not fill; before the saves copy blocks out, and before vLLM asks
        for ``load_errors()``."""
        job, self._layer_job = self._layer_job, None
        if job is None:
            return
        self._errors.update(job.result(self._layer_wait_s()))

    def _layer_wait_s(self) -> float:
        # the fetch is bounded by load_timeout_s; decoding and copying take far less
        return self.config.load_timeout_s + 5.0

    # ---- one load's steps ------------------------------------------------------------

    def _fetch_decoded(self, spec: LoadSpec, slot: object, check_later: bool = False) -> _Fetched:
        """Fetch and decode the stored prefix of ``spec``'s chunks; never raises (what
        could not be fetched or decoded is missing from ``decoded``). ``check_later``
        leaves the checksums to ``checks``, started here, which ``_settle`` waits for."""
        keys = [part_key(k, self.rank, self.tp) for k in spec.keys]
        t0 = time.perf_counter()
        decoded: list[tuple[torch.Tensor, torch.Tensor]] = []
        nbytes = 0
        stacked = views = checks = None
        try:
            grant = spec.shm[self.rank] if self.rank < len(spec.shm) else None
            views = self._shm_views(keys, grant)
            if grant is not None and views is not None and views.batch.lease_id == grant.lease_id:
                self._count("granted_loads", 1)
            payloads = views.views if views is not None else self._fetch(keys, slot)[: len(keys)]
            t1 = time.perf_counter()
            self._count("load_fetch_seconds", t1 - t0)
            got, error = codec.decode_many(
                payloads, defer_fp8=self._defer_fp8, checksums=not check_later
            )
            self._check_shape(got)
            decoded = got
            if check_later and decoded:
                checks = self._checker().submit(codec.checked_prefix, payloads[: len(decoded)])
            stacked = got.stacked or self._raw_stacked(slot, got, views)
            self._count("load_decode_seconds", time.perf_counter() - t1)
            nbytes = sum(memoryview(p).nbytes for p in payloads[: len(decoded)])
            if error is not None:
                raise error
        except Exception as exc:  # the chunks from here on are recomputed; the engine goes on
            log.warning(
                "kvstore load for %s stopped after %d chunks: %s", spec.req_id, len(decoded), exc
            )
        plan = self._scatter_plan(len(decoded), spec, stacked is not None)
        return _Fetched(spec, decoded, nbytes, t0, plan, stacked, views=views, checks=checks)

    def _checker(self) -> ThreadPoolExecutor:
        if self._check_pool is None:
            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-checksums")
        return self._check_pool

    def _shm_views(self, keys: list[bytes], grant: ShmGrant | None = None) -> ShmViews | None:
        """On the store's host, the stored prefix as views into its shared memory, leased
        (read there by the decode and the copy into blocks: no copy of its own); None to
        fetch instead (not on the host, several stores, a chunk not in shared memory).
        ``grant``, the scheduler's leased lookup's handles, saves asking for them again."""
        shm_views = getattr(self.client, "shm_views", None)  # not on a ShardedClient
        if not self.config.same_host or shm_views is None:
            return None  # the scheduler asks for grants only where this holds
        return shm_views(keys, timeout_s=self.config.load_timeout_s, grant=grant)

    def _raw_stacked(self, slot: object, decoded: list, views: ShmViews | None = None):
        """Same-host ``raw`` chunks lie one stride apart, in the slot's staging buffer or
        (read in place) in the store's region, as a chain put in one batch does: K and V
        of all of them as ``[n, L, H, T, D]`` views (no copy), so that each layer is
        written with one copy, not one per chunk. None where that does not hold."""
        if len(decoded) < 2 or not self.config.same_host or self.config.codec != "raw":
            return None
        size, count = self._payload_bytes(), len(decoded)
        if views is not None:
            base, offsets = torch.frombuffer(views.region, dtype=torch.uint8), views.offsets
        elif (base := self._staging.get(slot)) is not None:
            offsets = [j * size for j in range(count)]
        else:
            return None
        stride = offsets[1] - offsets[0]
        k0 = decoded[0][0]
        half, width = (size - codec.HEADER_BYTES) // 2, k0.element_size()
        if stride < size or any(b - a != stride for a, b in zip(offsets, offsets[1:count])):
            return None
        if any(x % width for x in (size, half, stride, offsets[0], codec.HEADER_BYTES)):
            return None
        rows = base.as_strided((count, size), (stride, 1), offsets[0])
        body = codec.HEADER_BYTES
        k = rows[:, body : body + half].view(k0.dtype).view(count, *k0.shape)
        v = rows[:, body + half : size].view(k0.dtype).view(count, *k0.shape)
        if views is not None:
            # chunk j was decoded from views.views[j], the region's bytes at offsets[j]
            # (both made from the same handles), so k[j], v[j] are its K and V when its
            # payload is `size` long; no view of each chunk is made (0.3-0.6 ms at 16K)
            same = all(p.nbytes == size for p in views.views[:count])
            return (k, v) if same else None
        # chunk j of k and v starts j strides on; checked by address, since indexing
        # k[j] for each chunk cost 1.7 ms of a 16K-token load (64 chunks) in an engine
        k_at, v_at = k.data_ptr(), v.data_ptr()
        same = all(
            kj.data_ptr() == k_at + j * stride and vj.data_ptr() == v_at + j * stride
            for j, (kj, vj) in enumerate(decoded)
        )
        return (k, v) if same else None

    def _write_layer(self, f: _Fetched, layer: int) -> None:
        if not f.written or not f.plan.ids:
            return
        try:
            self._scatter_layer(layer, f.decoded, f.plan, f.stacked)
        except Exception as exc:  # none of the blocks is trusted: all are recomputed
            f.written = False
            log.warning("kvstore load for %s could not write its blocks: %s", f.spec.req_id, exc)

    def _settle(self, f: _Fetched) -> set[int]:
        """Count a load whose layers were all written; the blocks it could not fill. A
        load read in place in shared memory ends its lease here: chunks whose slot was
        reused meanwhile (or all, if the lease may have lapsed) are not trusted."""
        spec, bpc = f.spec, self.blocks_per_chunk
        loaded = len(f.decoded) if f.written else 0
        if f.checks is not None:  # before the lease ends: the check reads the views too
            try:
                held = f.checks.result()
            except Exception:  # unreachable by design (checked_prefix only counts)
                held = 0
            if held < loaded:
                log.warning(
                    "kvstore load for %s: chunk %d failed its checksum; it and the rest "
                    "are recomputed",
                    spec.req_id,
                    held,
                )
            loaded = min(loaded, held)
        if f.views is not None:
            loaded = min(loaded, f.views.end())
        bad: set[int] = set()
        if loaded < len(spec.keys):
            self._count("load_failures", 1)
            bad.update(spec.block_ids[max(loaded * bpc, spec.first_block) :])
        if loaded:
            self._count("loaded_bytes", f.nbytes)
        self._count("loaded_chunks", loaded)
        self._count("loaded_tokens", max(0, loaded * bpc - spec.first_block) * self.block_size)
        self._count("load_seconds", time.perf_counter() - f.started)
        return bad

    def _fetch(self, keys: list[bytes], slot: object = 0) -> list:
        """Payloads of the stored prefix of ``keys``: on the store's host copied once, from
        its shared memory into a staging buffer of ``slot`` (one per load that may be in
        flight at once), reused across loads; else over gRPC."""
        if not self.config.same_host:
            return self.client.get(keys, timeout_s=self.config.load_timeout_s)
        size = self._payload_bytes()
        need = len(keys) * size
        staging = self._staging.get(slot)
        if staging is None or staging.numel() < need:
            staging = self._staging[slot] = torch.empty(need, dtype=torch.uint8)
        dests = [staging[i * size : (i + 1) * size] for i in range(len(keys))]
        n = self.client.get_shm_into(keys, dests, timeout_s=self.config.load_timeout_s)
        # decoded raw chunks are views of these (codec.decode): written before the slot's
        # next load
        return [memoryview(d.numpy()) for d in dests[:n]]

    def _payload_bytes(self) -> int:
        """Bytes of one chunk part's payload as this engine saves it."""
        shape = (self.ns.num_layers, self._heads(), self.config.chunk_tokens, self.ns.head_dim)
        src = codec.dtype_name(self._layers[0].dtype)
        return codec.HEADER_BYTES + expected_body_len(self.config.codec, src, shape)

    def _check_shape(self, decoded: codec.DecodedChunks) -> None:
        """A load's chunks share one shape (``decode_many``): it must be the engine's."""
        want = (self.ns.num_layers, self._heads(), self.config.chunk_tokens, self.ns.head_dim)
        if decoded and decoded.shape != want:
            raise ValueError(f"chunk shape {decoded.shape} does not match the engine's {want}")

    def scatter(self, decoded: list[tuple[torch.Tensor, torch.Tensor]], spec: LoadSpec) -> None:
        """Write the decoded leading chunks of ``spec`` into its blocks, every layer."""
        stacked = getattr(decoded, "stacked", None)
        plan = self._scatter_plan(len(decoded), spec, stacked is not None)
        if plan.ids:
            for layer in range(len(self._layers)):
                self._scatter_layer(layer, decoded, plan, stacked)

    def _scatter_plan(self, chunks: int, spec: LoadSpec, stacked: bool) -> _Plan:
        """The blocks the leading ``chunks`` of ``spec`` fill, and which tokens of each
        chunk go there; with a ``stacked`` batch, the trailing chunks taken whole are one
        part. Blocks before ``spec.first_block`` (already computed) are left alone."""
        bpc, ids, cuts = self.blocks_per_chunk, [], []
        for j in range(chunks):
            blocks = spec.block_ids[j * bpc : (j + 1) * bpc]
            skip = max(0, spec.first_block - j * bpc)
            if skip < len(blocks):
                ids.extend(blocks[skip:])
                cuts.append((j, slice(skip * self.block_size, len(blocks) * self.block_size)))
        n_whole = 0  # only the first chunk may be cut
        for _, tokens in reversed(cuts if stacked else []):
            if tokens.start or tokens.stop != self.config.chunk_tokens:
                break
            n_whole += 1
        if not n_whole:
            return _Plan(ids, cuts, None)
        head = cuts[: len(cuts) - n_whole]
        return _Plan(ids, head, (cuts[len(head)][0], cuts[-1][0] + 1))

    def _scatter_layer(self, layer: int, decoded: list, plan: _Plan, stacked=None) -> None:
        """One layer of every planned chunk in one indexed copy (a copy per chunk and layer
        cost more than its bytes); the whole chunks of a ``stacked`` batch as one part,
        written straight into the blocks where the layout can (``_write_whole``)."""
        cache = self._layers[layer]

        def part(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return k.to(cache.device, cache.dtype), v.to(cache.device, cache.dtype)

        parts = [
            part(decoded[j][0][layer][:, tokens], decoded[j][1][layer][:, tokens])
            for j, tokens in plan.cuts
        ]
        if plan.whole:
            first, last = plan.whole
            cut = sum(t.stop - t.start for _, t in plan.cuts) // self.block_size
            if self._write_whole(cache, plan.ids[cut:], stacked, layer, first, last):
                if parts:
                    self._layout.scatter_many(cache, plan.ids[:cut], parts)
                return
            if isinstance(stacked, Fp8Batch):  # each chunk decoded alone, then copied
                parts += [
                    part(decoded[j][0][layer], decoded[j][1][layer]) for j in range(first, last)
                ]
            else:
                parts.append(part(stacked[0][first:last, layer], stacked[1][first:last, layer]))
        self._layout.scatter_many(cache, plan.ids, parts)

    def _write_whole(self, cache, ids: list[int], stacked, layer: int, first: int, last: int):
        """Layer ``layer`` of the whole chunks ``[first, last)`` straight into their blocks
        (fp8 decoded, raw copied; no staging copy); False where the layout cannot."""
        if isinstance(stacked, Fp8Batch):
            return self._layout.write_fp8(cache, ids, stacked, layer, first, last)
        write_raw = getattr(self._layout, "write_raw", None)
        k, v = stacked[0][first:last, layer], stacked[1][first:last, layer]
        return write_raw is not None and write_raw(cache, ids, k, v)

    def _heads(self) -> int:
        return self.ns.num_kv_heads // self.tp if self.ns.num_kv_heads >= self.tp else 1

    def load_errors(self) -> set[int]:
        self._finish_layer_loads()
        errors, self._errors = self._errors, set()
        return errors

    # ---- saving ----------------------------------------------------------------------

    def save(self, meta: KVStoreMetadata) -> None:
        """Copy this step's chunks out of the cache and queue them; never raises."""
        self._finish_layer_loads()
        chunks: list[_Chunk] = []
        full = self._queue.full()
        for spec in meta.saves:
            try:
                self._gather(spec, chunks, full)
            except Exception as exc:
                self._log_once("gather", "kvstore save of %s failed: %r", spec.req_id, exc)
                self._count("save_failures", 1)
                self._end_chain(spec.req_id)
        if chunks:
            self._enqueue(chunks)

    def _gather(self, spec: SaveSpec, out: list[_Chunk], queue_full: bool) -> None:
        with self._idle:
            ended = spec.req_id in self._ended
        if ended:
            self._count("save_skipped", len(spec.keys))
            return
        bpc = self.blocks_per_chunk
        parent = spec.parent
        root = spec.root or spec.keys[0]
        for j, key in enumerate(spec.keys):
            chunk_bytes = self._chunk_bytes()
            with self._idle:
                over = self._queued_bytes + chunk_bytes > self.config.save_queue_bytes
                if not (queue_full or over):
                    self._queued_bytes += chunk_bytes
            if queue_full or over:
                # never stall the engine: the chain ends here, cleanly
                self._log_once(
                    "full",
                    "kvstore save queue full (save_queue_depth=%d steps, save_queue_bytes=%d): "
                    "chains end early; the store is slower than the engine",
                    self.config.save_queue_depth,
                    self.config.save_queue_bytes,
                )
                self._count("save_skipped", len(spec.keys) - j)
                self._end_chain(spec.req_id)
                return
            blocks = spec.block_ids[j * bpc : (j + 1) * bpc]
            try:
                k, v = self._gather_chunk(blocks)
            except Exception:
                with self._idle:
                    self._queued_bytes -= chunk_bytes
                raise
            # the copies are the connector's now; encoding and sending can wait for the thread
            out.append(_Chunk(spec.req_id, key, parent, k, v, root))
            parent = key

    def _gather_chunk(self, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's K and V, ``[layers, H, T, D]``, each layer copied out of the cache
        straight into its place (stacking per-layer copies afterwards copied it all again,
        on the engine's thread)."""
        first = self._layers[0]
        tokens = len(blocks) * self.block_size
        shape = (len(self._layers), first.shape[1], tokens, self.ns.head_dim)
        try:
            k, v = self._spare.pop()  # a sent chunk's, faulted in already
        except IndexError:
            k = v = None
        if k is None or k.shape != shape or k.dtype != first.dtype or k.device != first.device:
            k = torch.empty(shape, dtype=first.dtype, device=first.device)
            v = torch.empty(shape, dtype=first.dtype, device=first.device)
        try:
            for i, cache in enumerate(self._layers):
                self._layout.gather(cache, blocks, out=(k[i], v[i]))
        except BaseException:
            if k.device.type == "cpu":
                self._spare.append((k, v))  # nothing of it is saved: the next gather's
            raise
        return k, v

    def _chunk_bytes(self) -> int:
        """Bytes of one chunk's copied K and V in the engine's dtype."""
        per_token = 2 * self._heads() * self.ns.head_dim * self._layers[0].element_size()
        return self.ns.num_layers * self.config.chunk_tokens * per_token

    def _end_chain(self, req_id: str) -> None:
        with self._idle:
            if req_id in self._ended:
                return
            self._ended.add(req_id)
            self.counters.chains_ended += 1

    def _fail_chain(self, req_id: str) -> None:
        """The sender could not store a chunk of ``req_id``: end its chain, queued chunks too."""
        with self._idle:
            self._send_failed.add(req_id)
        self._end_chain(req_id)

    def finished(self, req_ids) -> None:
        """Requests vLLM finished: forget their ended chains."""
        with self._idle:
            self._ended.difference_update(req_ids)
            self._send_failed.difference_update(req_ids)

    def _enqueue(self, chunks: list[_Chunk]) -> None:
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_loop, daemon=True, name="kvstore-save"
            )
            self._sender.start()
        with self._idle:
            self._pending += 1
        self._queue.put_nowait(chunks)

    def _send_loop(self) -> None:
        while True:
            chunks = self._queue.get()
            if chunks is None:
                return
            try:
                self._send(chunks)
            except Exception as exc:  # a bug here must not kill the sender
                self._log_once("send", "kvstore sender failed: %r", exc)
                self._count("save_failures", len(chunks))
            finally:
                # sent (or given up): nothing reads these copies any more; on a GPU the
                # caching allocator reuses device memory by itself
                self._spare.extend((c.k, c.v) for c in chunks if c.k.device.type == "cpu")
                with self._idle:
                    self._queued_bytes -= len(chunks) * self._chunk_bytes()
                    self._pending -= 1
                    self._idle.notify_all()

    def _send(self, chunks: list[_Chunk]) -> None:
        records: list[ChunkRecord | Fill] = []
        owners, roots = {}, {}
        name, same_host = self.config.codec, self.config.same_host
        t0 = time.perf_counter()
        for c in chunks:
            with self._idle:
                failed = c.req_id in self._send_failed
            if failed:  # an earlier chunk of its chain was not stored: this one is an orphan
                self._count("save_skipped", 1)
                continue
            key = part_key(c.key, self.rank, self.tp)
            parent = part_key(c.parent, self.rank, self.tp) if c.parent else None
            try:
                if same_host:  # encoded straight into the store's shared memory, in put
                    n = codec.payload_len(c.k, c.v, name)
                    encode = functools.partial(codec.encode, c.k, c.v, name)
                    records.append(Fill(key, parent, self.ns_digest, n, encode))
                else:
                    payload = codec.encode(c.k, c.v, name)
                    records.append(ChunkRecord(key, parent, self.ns_digest, payload))
            except Exception as exc:
                self._log_once("encode", "kvstore could not encode a chunk: %r", exc)
                self._count("save_failures", 1)
                self._fail_chain(c.req_id)
                continue
            owners[key] = c.req_id
            roots[key] = part_key(c.root, self.rank, self.tp)
        if not records:
            return
        try:
            kw = {"root": roots} if isinstance(self.client, ShardedClient) else {}
            result = self.client.put(
                records, timeout_s=self.config.save_timeout_s, shm=same_host, **kw
            )
        except Exception as exc:
            self._log_once("put", "kvstore save failed (chunks dropped): %s", exc)
            self._count("save_failures", len(records))
            for req_id in set(owners.values()):
                self._fail_chain(req_id)
            return
        self._count("save_seconds", time.perf_counter() - t0)
        self._count("saved_chunks", result.stored + result.duplicates)
        refused = {key for key, _ in result.rejected}
        self._count(
            "saved_bytes",
            sum(payload_bytes(r) for r in records if r.key not in refused),
        )
        if result.rejected:
            self._count("save_failures", len(result.rejected))
            self._log_once("refused", "kvstore refused a chunk: %s", result.rejected[0][1])
            for key, _ in result.rejected:
                if key in owners:
                    self._fail_chain(owners[key])

    def _count(self, name: str, n: int) -> None:
        with self._idle:  # two threads count
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def _log_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg + " (logged once; see the connector's counters)", *args)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued saves were sent (tests and shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._finish_layer_loads()
        for jobs in (self._loader, self._layer_jobs):
            if jobs is not None:
                jobs.put(None)
        self.flush(self.config.save_timeout_s)
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=5)
        self._spare.clear()
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
