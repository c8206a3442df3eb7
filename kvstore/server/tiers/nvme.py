"""NVMe tier: chunks in one LMDB environment, written by one writer thread.

Offers ``NvmeTier``: the ``Tier`` interface (``write`` waits for its batch to
commit; batches queued meanwhile by other threads share one transaction),
``read_into(key, dest)`` (copy or decompress straight into the caller's buffer),
``scan()`` (headers only, to rebuild the index at start) and ``corrupt_count``.

Values are framed by ``nvme_format`` (header with namespace, parent, raw length and
an xxh3-64 checksum, then the zstd or raw body). A value that fails its checksum
reads as a miss: ``None`` is returned, ``corrupt_count`` grows and the entry is
deleted through the writer, so no later read meets it.

Durability: ``sync=False`` (the default) survives a crash of this process, since
committed pages sit in the OS page cache, but not a power loss or kernel crash,
which may lose or damage recent transactions. It is the right trade for a cache
whose content can be recomputed; ``sync=True`` flushes every commit to the disk.
``close()`` flushes in both modes.

One store per data directory: the tier holds an flock on ``kvstore.lock`` there
while open and refuses a directory another live process holds. Only the writer
thread ever opens a write transaction. The store's put process opens the same
directory with ``lock_dir=False`` and writes the chunks it was given room for (see
``kvstore.server.shm_puts``); LMDB serialises the two processes' transactions.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import lmdb
import numpy as np
import zstandard

from kvstore.core.types import (
    KEY_BYTES,
    ChunkKey,
    ChunkRecord,
    InvalidArgument,
    KVStoreError,
    TierFullError,
    check_key,
    check_ns,
)
from kvstore.server.tiers.base import StoredChunk
from kvstore.server.tiers.buffers import as_u8
from kvstore.server.tiers.nvme_format import (
    COMPRESSION,
    HEADER,
    Header,
    body_of,
    frame_into,
    framed_size,
    parse_header,
    seal,
    verify,
)
from kvstore.server.tiers.pacing import PIECE, step_aside

log = logging.getLogger(__name__)
MAX_TXN_BYTES = 64 << 20
LOCK_FILE = "kvstore.lock"
DISK_SLACK = 4 << 20
# nvme.map_size 0: this, or less to fit the disk (see fit_map_size)
AUTO_MAP_SIZE = 64 << 30
AUTO_FREE_SHARE = 0.9
MIN_AUTO_MAP_SIZE = 256 << 20
HEADER_BYTES = HEADER.size
ZSTD_PIECE = PIECE  # compressed a piece at a time: see _compress_into
ZSTD_SLACK = 1 << 16  # zstd's frame and block headers over the input size, generously


@dataclass(slots=True)
class _Job:
    kind: str  # "put", "delete" or "drop" (delete only if the stored value is corrupt)
    items: Sequence  # ChunkRecords for "put", keys otherwise
    nbytes: int
    future: Future


def _finish(job: _Job, error: Exception | None = None) -> None:
    """Wake the job's caller, dropping its items first: the payloads are the caller's again
    from then on, and one the writer still held (a 32 MiB one, say, until the next job)
    would stay alive for nothing and keep a Put's part buffer out of reuse."""
    job.items = ()
    if error is None:
        job.future.set_result(None)
    else:
        job.future.set_exception(error)


class NvmeTier:
    name = "nvme"
    persistent = True

    def __init__(
        self,
        path: str,
        map_size: int,
        *,
        compression: str = "zstd",
        zstd_level: int = 1,
        sync: bool = False,
        max_readers: int = 126,
        max_txn_bytes: int = MAX_TXN_BYTES,
        lock_dir: bool = True,
    ) -> None:
        if compression not in COMPRESSION:
            raise InvalidArgument(f"nvme compression must be one of {sorted(COMPRESSION)}")
        self.path = path
        self.compression = compression
        self.corrupt_count = 0
        self._comp = COMPRESSION[compression]
        try:
            # Used by the writer thread only; built here so a bad level fails the constructor.
            self._cctx = zstandard.ZstdCompressor(level=zstd_level)
        except (ValueError, zstandard.ZstdError) as e:
            raise InvalidArgument(f"nvme zstd_level {zstd_level} is invalid: {e}") from e
        self._scratch = bytearray()
        self._max_txn_bytes = max_txn_bytes
        os.makedirs(path, exist_ok=True)
        # a read-only data directory (a read-only mount, say) is served read-only
        self.read_only = not os.access(path, os.W_OK)
        if self.read_only:
            log.warning("nvme tier: %s is read-only: serving its chunks, refusing puts", path)
            map_size = map_size or AUTO_MAP_SIZE  # the file's own size wins if larger
        elif lock_dir:  # else the store that holds the lock sized and checked it
            map_size = fit_map_size(path, map_size)
            _check_disk_room(path, map_size)
        self.capacity_bytes = map_size
        self._dir_lock = _lock_data_dir(path, self.read_only) if lock_dir else None
        try:
            # readahead stays on: without it cold reads fall to a few dozen MB/s.
            self._env = lmdb.open(
                path,
                map_size=map_size,
                subdir=True,
                # writemap would make LMDB's data file a sparse mapping whose holes the
                # kernel fills on first touch: on a full disk that is SIGBUS, not an error.
                writemap=False,
                sync=sync,
                metasync=sync,
                readahead=True,
                lock=True,
                max_readers=max_readers,
                max_dbs=0,
                readonly=self.read_only,
            )
        except lmdb.Error as e:
            if self._dir_lock is not None:
                os.close(self._dir_lock)
            raise KVStoreError(f"nvme tier: cannot open LMDB at {path}: {e}") from e
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="kvstore-nvme-writer", daemon=True)
        self._writer.start()

    def cost(self, nbytes: int) -> int:
        """The uncompressed size: an upper bound for zstd, a slight underestimate (header, page
        rounding) for raw values, so the index should keep its watermark below ``map_size``."""
        return nbytes

    # -- writes: all through the writer thread -------------------------------------------------

    def write(self, records: Sequence[ChunkRecord]) -> None:
        """Store a batch in one transaction, all or nothing; returns once it is committed."""
        self._submit("put", self._checked(records)).result()

    def delete(self, keys: Sequence[ChunkKey]) -> None:
        """Drop a batch. On a read-only directory this forgets nothing on disk: the chunks
        come back at the next start (their bytes are still right for their keys)."""
        if self.read_only:
            return
        self._submit("delete", [bytes(k) for k in keys]).result()

    def _checked(self, records: Sequence[ChunkRecord]) -> list[ChunkRecord]:
        out = []
        for r in records:
            key = check_key(r.key)
            parent = None if r.parent is None else check_key(r.parent, "parent")
            out.append(ChunkRecord(key, parent, check_ns(r.ns), as_u8(r.payload)))
        return out

    def _submit(self, kind: str, items: Sequence) -> Future:
        if self._closed:
            raise KVStoreError("nvme tier is closed")
        if self.read_only:
            raise KVStoreError(
                f"nvme tier: {self.path} is not writable (read-only); reads still work"
            )
        if threading.current_thread() is self._writer:
            raise KVStoreError("nvme tier: waiting for the writer from its own thread deadlocks")
        nbytes = sum(r.payload.nbytes for r in items) if kind == "put" else 0
        job = _Job(kind, items, nbytes, Future())
        self._queue.put(job)
        return job.future

    def _run(self) -> None:
        stop = False
        while not stop:
            job = self._queue.get()
            if job is None:
                return
            group, size = [job], job.nbytes
            while size < self._max_txn_bytes:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
                size += nxt.nbytes
            self._commit(group)

    def _commit(self, group: list[_Job]) -> None:
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                for job in group:
                    self._apply(txn, job)
        except Exception as e:
            if len(group) > 1:
                # One bad batch must not fail the others it shared a transaction with.
                for job in group:
                    self._commit([job])
                return
            _finish(group[0], self._translate(e, group[0].nbytes))
            return
        for job in group:
            _finish(job)

    def _disk_full(self, code: int | None, nbytes: int) -> bool:
        # LMDB reports a short write as EIO: a disk without room for the transaction
        # (and some page slack) is the likely cause, and then it is a full tier, not a fault
        if code == errno.ENOSPC:
            return True
        if code != errno.EIO:
            return False
        try:
            return shutil.disk_usage(self.path).free < 2 * nbytes + DISK_SLACK
        except OSError:
            return False

    def _translate(self, e: Exception, nbytes: int = 0) -> Exception:
        if isinstance(e, lmdb.MapFullError):
            err: Exception = TierFullError(
                f"nvme tier full: map_size={self.capacity_bytes} B reached; raise nvme map_size"
            )
        elif isinstance(e, KVStoreError):
            return e
        elif self._disk_full(_errno_of(e), nbytes):
            err = TierFullError(f"nvme tier full: the disk under {self.path} is full")
        elif _errno_of(e) in (errno.EROFS, errno.EACCES, errno.EPERM):
            err = KVStoreError(f"nvme tier: {self.path} is not writable ({e}); reads still work")
        else:
            err = KVStoreError(f"nvme write failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err

    def _apply(self, txn: lmdb.Transaction, job: _Job) -> None:
        if job.kind == "put":
            for rec in job.items:
                txn.put(rec.key, self._encode(rec))
        elif job.kind == "delete":
            for key in job.items:
                txn.delete(key)
        else:
            for key in job.items:
                value = txn.get(key)
                if value is not None and verify(key, value) is None:
                    txn.delete(key)

    def _encode(self, rec: ChunkRecord) -> memoryview:
        """The stored value, built in a reused scratch buffer (valid until the next call)."""
        src = memoryview(rec.payload)
        if self._comp:
            value = self._compress_into(rec, src)
            if value is not None:
                return value
        body = memoryview(self._cctx.compress(src) if self._comp else src)
        return frame_into(
            self._room(len(body)), rec.key, rec.parent, rec.ns, self._comp, src.nbytes, body
        )

    def _compress_into(self, rec: ChunkRecord, src: memoryview) -> memoryview | None:
        """Compress ``src`` in pieces straight into the scratch buffer; None if it overflowed.

        One ``compress`` call builds its whole output as one bytes object, and resizing that
        copies it with the GIL held (5 ms for 32 MiB here, a stall for every lookup); a
        stream of 256 KiB pieces never holds the GIL for more than a piece's copy. After
        each piece the writer offers its core to any thread waiting for one (a lookup's,
        say), so that waits for the writer's core last a piece's compression (~0.7 ms),
        not a payload's: lookup p99 under a stream of 64 MiB puts 6.7-7.2 -> 4.9-6.5 ms
        in paired runs here.
        """
        n = src.nbytes
        out = self._room(n + (n >> 7) + ZSTD_SLACK)
        at = HEADER_BYTES
        stream = self._cctx.compressobj(size=n)
        for i in range(0, n + ZSTD_PIECE, ZSTD_PIECE):  # the last step flushes
            piece = stream.compress(src[i : i + ZSTD_PIECE]) if i < n else stream.flush()
            step_aside()
            if at + len(piece) > len(out):
                return None  # beyond zstd's own bound: cannot happen, but be safe
            out[at : at + len(piece)] = piece
            at += len(piece)
        return seal(out, rec.key, rec.parent, rec.ns, self._comp, n, at - HEADER_BYTES)

    def _room(self, body_len: int) -> memoryview:
        if len(self._scratch) < framed_size(body_len):
            self._scratch = bytearray(framed_size(body_len))
        return memoryview(self._scratch)

    # -- reads: any thread, one read transaction per call ---------------------------------------

    def read(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Owned copies of the payloads; None for missing or corrupt values."""
        out: list[bytes | None] = []
        corrupt: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for key in keys:
                key = bytes(key)
                value = txn.get(key)
                payload = None if value is None else self._decode(key, value)
                if value is not None and payload is None:
                    corrupt.append(key)
                out.append(payload)
        self._drop(corrupt)
        return out

    def holding(self, keys: Sequence[ChunkKey]) -> list[bytes]:
        """Those of ``keys`` that have a value here (not checked: a header lookup each)."""
        with self._env.begin(buffers=True) as txn:
            return [bytes(k) for k in keys if txn.get(bytes(k)) is not None]

    def read_into(self, key: ChunkKey, dest: bytearray | memoryview | np.ndarray) -> int | None:
        """Copy or decompress one payload straight into ``dest`` (writable, C-contiguous).

        Returns the payload length, or None when the key is missing or its value is corrupt
        (then ``dest`` may hold garbage).
        """
        key = bytes(key)
        out = memoryview(as_u8(dest, "dest"))
        with self._env.begin(buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                return None
            head = verify(key, value)
            if head is not None and head.raw_len > len(out):
                raise InvalidArgument(f"nvme: dest holds {len(out)} B, chunk is {head.raw_len} B")
            ok = head is not None and self._decode_into(head, body_of(value), out)
        if not ok:
            self._drop([key])
            return None
        return head.raw_len

    def _decode(self, key: bytes, value: memoryview) -> bytes | None:
        head = verify(key, value)
        if head is None:
            return None
        body = body_of(value)
        if head.compression == COMPRESSION["none"]:
            return bytes(body)
        try:
            raw = self._dctx().decompress(body, max_output_size=head.raw_len)
        except zstandard.ZstdError:
            return None
        return raw if len(raw) == head.raw_len else None

    def _decode_into(self, head: Header, body: memoryview, out: memoryview) -> bool:
        if head.compression == COMPRESSION["none"]:
            # numpy copies without the GIL (a slice assignment holds it for the whole copy)
            np.copyto(np.frombuffer(out, np.uint8, head.raw_len), np.frombuffer(body, np.uint8))
            return True
        done = 0
        try:
            with self._dctx().stream_reader(body) as reader:
                while done < head.raw_len:
                    n = reader.readinto(out[done : head.raw_len])
                    if n == 0:
                        break
                    done += n
                return done == head.raw_len and reader.read(1) == b""
        except zstandard.ZstdError:
            return False

    def _dctx(self) -> zstandard.ZstdDecompressor:
        # A decompressor must not be used by two threads at once: one per reading thread.
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def _drop(self, keys: list[bytes]) -> None:
        """Count corrupt values and delete them (waiting, so no later read meets them)."""
        if not keys:
            return
        with self._count_lock:
            self.corrupt_count += len(keys)
        if not self.read_only:  # else every read of them fails its checksum again: still a miss
            self._submit("drop", keys).result()

    # -- start and stop --------------------------------------------------------------------------

    def scan(self) -> Iterator[StoredChunk]:
        """Every stored chunk as (key, parent, ns, raw size), reading headers only."""
        bad: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                key = bytes(key)
                head = parse_header(value) if len(key) == KEY_BYTES else None
                if head is None:
                    bad.append(key)
                    continue
                yield StoredChunk(key, head.parent, head.ns, head.raw_len)
        self._drop(bad)

    def close(self) -> None:
        """Commit everything queued, stop the writer, flush and close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        # A write that raced with close() queued behind the stop mark: fail it, do not hang it.
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.set_exception(KVStoreError("nvme tier closed before the write ran"))
        self._env.sync(True)
        self._env.close()
        if self._dir_lock is not None:
            os.close(self._dir_lock)


def _lock_data_dir(path: str, read_only: bool) -> int:
    """Hold ``path/kvstore.lock`` for as long as this tier is open; refuse a held one.

    Two stores on one LMDB would each keep an index of it, blind to the other's
    evictions and deletes. The kernel drops an flock when its holder dies, so a
    crashed store never blocks its restart.
    """
    lock_path = os.path.join(path, LOCK_FILE)
    if read_only:
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDONLY)  # a directory can carry the flock as well
    else:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise KVStoreError(
            f"nvme tier: data directory {path} is in use by another kvstore (pid {holder}); "
            "stop it, or give this store its own nvme.path"
        ) from None
    if not read_only:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _errno_of(e: Exception) -> int | None:
    """The OS error behind an LMDB failure (py-lmdb puts it in the message only)."""
    text = str(e)
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO):
        if os.strerror(code) in text:
            return code
    return getattr(e, "errno", None)


def _disk_room(path: str) -> tuple[int, int]:
    """(bytes the tier's data file already holds on disk, bytes free on its filesystem)."""
    data = os.path.join(path, "data.mdb")
    allocated = os.stat(data).st_blocks * 512 if os.path.exists(data) else 0
    return allocated, shutil.disk_usage(path).free


def fit_map_size(path: str, map_size: int) -> int:
    """The map size to open: ``map_size``, or for 0 the largest that fits the disk.

    0 means AUTO_MAP_SIZE, or what the tier holds already plus AUTO_FREE_SHARE of the free
    space where that is less (rounded down to a whole MiB); below MIN_AUTO_MAP_SIZE the disk
    is too full to be worth a tier, and that is an error naming the free space."""
    if map_size > 0:
        return map_size
    allocated, free = _disk_room(path)
    fitted = min(AUTO_MAP_SIZE, allocated + int(free * AUTO_FREE_SHARE)) // (1 << 20) * (1 << 20)
    if fitted < MIN_AUTO_MAP_SIZE:
        raise InvalidArgument(
            f"nvme tier: {path} has only {free} B free ({allocated} B already in use); "
            f"free disk space, point nvme.path elsewhere, or set nvme.map_size explicitly"
        )
    if fitted < AUTO_MAP_SIZE:
        log.info(
            "nvme tier: map_size %d B (%.0f%% of the %d B free on %s, plus %d B in use)",
            fitted,
            AUTO_FREE_SHARE * 100,
            free,
            path,
            allocated,
        )
    return fitted


def _check_disk_room(path: str, map_size: int) -> None:
    # Refuse at start a map the disk cannot hold; a disk that fills later makes writes
    # fail with ENOSPC (TierFullError), never the process.
    allocated, free = _disk_room(path)
    if map_size - allocated > free:
        raise InvalidArgument(
            f"nvme map_size={map_size} B does not fit: {path} has {free} B free "
            f"and {allocated} B already in use; lower nvme map_size (0 fits it to the "
            "disk) or free disk space"
        )
