"""Typed clients for the kvstore gRPC service: ``KVStoreClient`` (sync) and
``AsyncKVStoreClient`` (asyncio).

Both offer ``lookup``, ``get``, ``put``, ``release``, ``delete``, ``stats``,
``explain``, ``ping`` and ``close``. One channel per client, reused by every
call; every call has a deadline; gRPC retries idempotent calls on
``UNAVAILABLE`` with backoff within that deadline (a service-config
``retryPolicy``), and never ``Release``. Errors surface as ``ClientError`` with
the gRPC status code and the server's message. Payloads come back as zero-copy views
of the received messages. ``KVStoreClient`` sends its puts to the store's put process
when the store has one (``kvstore.client.put_routes``), and to the store when it is down;
``AsyncKVStoreClient`` always puts to the store. A client on the same host as the store
may ask for shared-memory handles (``shm=True``) and copy straight from the DRAM tier; a
copy it cannot trust (``kvstore.client.shm_reader``) is read again over TCP. Never imports
server code, so a vLLM process loads neither the index nor the tiers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client.local_calls import LOCAL_METHODS, LocalCallError, LocalCalls
from kvstore.client.put_routes import FALLBACK, PutRoutes, put_target
from kvstore.client.shm_reader import ShmReader, ShmReadStats, copiers
from kvstore.core import wire
from kvstore.core.types import ChunkRecord, KVStoreError, LookupResult, PutResult, ShmGrant
from kvstore.rpc.pb import SERVICE, pb
from kvstore.rpc.tls import ClientAuth

DEFAULT_MAX_MESSAGE = 65 << 20
PUT_BATCH_BYTES = 4 << 20
PUT_SPLIT_BYTES = 4 << 20
PUT_PART_BYTES = 1 << 20
# gRPC clamps a retryPolicy's maxAttempts to 5 (and logs an error when asked for more).
MAX_ATTEMPTS = 5
# A shared-memory copy that ends within this fraction of its lease (counted from before the
# GetShm was sent) is trusted without waiting for the Release answer (``_end_lease``).
LEASE_TRUSTED_FRACTION = 0.5
# A leased lookup's shared-memory handles are used by a reader only this early in their
# lease (a load that starts later asks GetShm for a lease of its own), so that the read
# ends well within LEASE_TRUSTED_FRACTION of it.
GRANT_FRESH_FRACTION = 0.25
# The calls gRPC may retry: asking again changes nothing the caller did not ask for. A retried
# Lookup with a lease (or a reservation) or ReserveShm may leave a second one behind, which
# lapses; Put stores duplicates. Release is not here: a retry after a lost answer would say
# NOT_FOUND for a lease that was released. Nor is CommitShm: its ticket is spent on success.
_RETRIED = {
    SERVICE: (
        "Lookup",
        "Get",
        "GetShm",
        "Put",
        "ReserveShm",
        "Delete",
        "Stats",
        "Explain",
        "Routes",
    ),
    "grpc.health.v1.Health": ("Check",),
}


@dataclass
class ShmViews:
    """``KVStoreClient.shm_views``: ``views[i]`` is the payload of ``keys[i]`` in the
    store's region (``region``; its offset there is ``offsets[i]``), leased until ``end``."""

    client: KVStoreClient
    batch: pb.ShmBatch
    sent: float
    keys: Sequence[bytes]
    region: memoryview | None
    views: list[memoryview]
    ended: int | None = None

    @property
    def offsets(self) -> list[int]:
        return [h.offset for h in self.batch.handles]

    def end(self) -> int:
        """Release the lease; how many leading views held their chunk throughout (0 when
        the lease may have lapsed: then any slot may have been reused). Once only."""
        if self.ended is not None:
            return self.ended
        good = 0
        if self.views:
            good = self.client._shm.unchanged(self.region, self.keys, self.batch.handles)
            held = self.client._end_lease(self.batch, self.sent)
            good = self.client._shm.stats.count(len(self.views), good, held)
        self.ended = good
        return good


class ClientError(KVStoreError):
    """A failed call: ``code`` is the gRPC status, the message is the server's."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method, self.code, self.details = method, code, details


@dataclass(frozen=True, slots=True)
class ClientOptions:
    timeout_s: float = 5.0
    # retries of a call in _RETRIED that failed UNAVAILABLE, within its deadline (a store still
    # down when the deadline passes during a wait is DEADLINE_EXCEEDED); gRPC makes at most
    # MAX_ATTEMPTS attempts, so more than 4 count as 4
    retries: int = 2
    # the first retry waits up to this long, each later one up to twice the one before
    # (gRPC draws each wait at random below its bound)
    backoff_s: float = 0.05
    # how long one attempt to connect (TCP, TLS, HTTP/2's first SETTINGS) may take before
    # gRPC gives it up and backs off; a store whose handshake is slower is never reached
    connect_timeout_s: float = 2.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE
    put_batch_bytes: int = PUT_BATCH_BYTES
    # a chunk's payload longer than put_split_bytes is put in parts of put_part_bytes, so
    # that no one gRPC message holds a large chunk: the store's Python server builds each
    # received message with its GIL held, which holds up its lookups (a 32 MiB message
    # stalled them for tens of ms; under a stream of 64 MiB puts the lookups' p99 was
    # 6-9 ms with 4 MiB parts, 4-5 ms with 1 MiB parts). put_part_bytes 0 sends every chunk
    # whole, as stores from before parts need.
    put_split_bytes: int = PUT_SPLIT_BYTES
    put_part_bytes: int = PUT_PART_BYTES
    # how long a shared-memory read may take before the store may reuse its slots;
    # None takes the server's default. A read that outlasts it is redone over TCP.
    shm_lease_ttl_s: float | None = None
    # TLS and token; None reads KVSTORE_TLS_CA/_CERT/_KEY and KVSTORE_TOKEN(_FILE)
    auth: ClientAuth | None = None
    # send puts (those not over shared memory) to the store's put process when it has one
    # (it says so in Routes), so that they do not slow its lookups; False: to the store
    route_puts: bool = True
    # send ReserveShm, CommitShm, Lookup and GetShm to a store on this host over its Unix
    # socket when it names one (Routes; kvstore.client.local_calls): gRPC costs 0.4-1 ms more
    local_calls: bool = True

    def __post_init__(self) -> None:
        if self.retries < 0 or not (math.isfinite(self.backoff_s) and self.backoff_s > 0):
            raise ValueError(
                f"retries must be >= 0 and backoff_s a positive number of seconds, "
                f"got {self.retries} and {self.backoff_s}"
            )
        if self.put_part_bytes < 0 or self.put_split_bytes < 0:
            raise ValueError(
                f"put_part_bytes and put_split_bytes must be >= 0 (put_part_bytes 0: no "
                f"parts), got {self.put_part_bytes} and {self.put_split_bytes}"
            )
        if not (math.isfinite(self.connect_timeout_s) and self.connect_timeout_s >= 0.1):
            raise ValueError(
                f"connect_timeout_s must be at least 0.1 s (gRPC's floor), "
                f"got {self.connect_timeout_s}"
            )
        ttl = self.shm_lease_ttl_s
        if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"shm_lease_ttl_s must be a positive number of seconds, got {ttl}")


def _channel_options(opts: ClientOptions) -> list[tuple[str, int | str]]:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        # A store that restarts is back within a second or two; gRPC's default backoff
        # (growing to two minutes) would leave a long-lived client failing fast meanwhile.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # gRPC reads this one as the time a connection attempt may take, not as a backoff:
        # at 100 ms (as it was) a store whose handshake took longer (a loaded host, TLS
        # over a long link) failed every call UNAVAILABLE, whatever its deadline.
        ("grpc.min_reconnect_backoff_ms", round(opts.connect_timeout_s * 1000)),
    ]
    if opts.retries:
        options += [
            ("grpc.service_config", _service_config(opts)),
            # gRPC retries a client stream only while it still holds every message sent: with
            # its default 256 KiB, no Put of even 8 test chunks was retried (measured against a
            # store started 0.3 s late). Holding one largest message lets a Put of up to
            # max_message_bytes be retried; a larger one fails on UNAVAILABLE as with no
            # retries. The bytes are held until the store answers (a 32 MiB put: ~30 MiB more
            # peak memory, same speed); gRPC caps all of a channel's calls at 256 MiB.
            ("grpc.per_rpc_retry_buffer_size", opts.max_message_bytes),
        ]
    return options


def _service_config(opts: ClientOptions) -> str:
    attempts = min(opts.retries + 1, MAX_ATTEMPTS)
    policy = {
        "maxAttempts": attempts,
        "initialBackoff": f"{opts.backoff_s:.9f}s",
        "maxBackoff": f"{opts.backoff_s * 2 ** (attempts - 2):.9f}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": s, "method": m} for s, methods in _RETRIED.items() for m in methods]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def _method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _batches(records: Sequence[ChunkRecord], limit: int) -> list[list[ChunkRecord]]:
    """Chunks grouped into PutRequests of about ``limit`` bytes each, kept in order."""
    out: list[list[ChunkRecord]] = []
    batch: list[ChunkRecord] = []
    size = 0
    for rec in records:
        n = memoryview(rec.payload).nbytes
        if batch and size + n > limit:
            out.append(batch)
            batch, size = [], 0
        batch.append(rec)
        size += n
    if batch:
        out.append(batch)
    return out


def _encoded(
    batches: list[list[ChunkRecord]], part_bytes: int, split_bytes: int
) -> Iterator[bytes]:
    # One message at a time, as gRPC sends them: encoding them all up front held the whole
    # put in freshly allocated memory, whose page faults cost about a fifth of a put's time.
    for batch in batches:
        whole: list[ChunkRecord] = []
        for rec in batch:
            payload = memoryview(rec.payload).cast("B")  # parts are cut in bytes
            if not part_bytes or payload.nbytes <= max(split_bytes, part_bytes):
                whole.append(rec)
                continue
            first = dataclasses.replace(rec, payload=payload[:part_bytes])
            yield wire.encode_put_request([*whole, first], total_length=payload.nbytes)
            whole = []
            for pos in range(part_bytes, payload.nbytes, part_bytes):
                yield wire.encode_put_part(payload[pos : pos + part_bytes])
        if whole:
            yield wire.encode_put_request(whole)


def _lookup_result(resp: pb.LookupResponse, sent: float = 0.0) -> LookupResult:
    grant = None
    if resp.handles and resp.lease_id and resp.lease_ttl_s > 0:
        handles = tuple((h.region, h.offset, h.length) for h in resp.handles)
        grant = ShmGrant(resp.lease_id, resp.lease_ttl_s, sent, handles)
    return LookupResult(
        resp.matched, list(resp.tiers), resp.lease_id or None, resp.pending, resp.reserved, grant
    )


def _put_result(resp: pb.PutResponse) -> PutResult:
    return PutResult(resp.stored, resp.duplicates, [(r.key, r.reason) for r in resp.rejected])


def _decode_get(messages) -> list[memoryview]:
    """Payload views of Get messages, up to the first without one."""
    payloads = []
    for message in messages:
        payload = wire.parse_chunk(message)[1]
        if payload is None:
            break
        payloads.append(payload)
    return payloads


class KVStoreClient:
    def __init__(self, target: str, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        auth = self.options.auth or ClientAuth.from_env()
        options = _channel_options(self.options)
        self._channel = auth.channel(target, options)
        ch = self._channel
        self._routes: PutRoutes | None = None  # None: every put goes to the store
        if self.options.route_puts and put_target(target, 0) is not None:
            self._routes = PutRoutes(target, ch, lambda address: auth.channel(address, options))
        self._local = LocalCalls(target, ch, auth.token) if self.options.local_calls else None
        self._lookup = ch.unary_unary(
            _method("Lookup"), pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
        )
        self._get = ch.unary_stream(_method("Get"), pb.GetRequest.SerializeToString, None)
        self._get_shm = ch.unary_unary(
            _method("GetShm"), pb.GetShmRequest.SerializeToString, pb.ShmBatch.FromString
        )
        self._put = ch.stream_unary(_method("Put"), None, pb.PutResponse.FromString)
        self._reserve_shm = ch.unary_unary(
            _method("ReserveShm"),
            pb.ReserveShmRequest.SerializeToString,
            pb.ShmReservation.FromString,
        )
        self._commit_shm = ch.unary_unary(
            _method("CommitShm"), pb.CommitShmRequest.SerializeToString, pb.PutResponse.FromString
        )
        self._release = ch.unary_unary(
            _method("Release"), pb.ReleaseRequest.SerializeToString, pb.ReleaseResponse.FromString
        )
        self._delete = ch.unary_unary(
            _method("Delete"), pb.DeleteRequest.SerializeToString, pb.DeleteResponse.FromString
        )
        self._stats = ch.unary_unary(
            _method("Stats"), pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString
        )
        self._explain = ch.unary_unary(
            _method("Explain"), pb.ExplainRequest.SerializeToString, pb.ExplainResponse.FromString
        )
        self._health = health_pb2_grpc.HealthStub(ch)
        self._shm = ShmReader()
        self._release_queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None
        self._closing = False  # no release_later once close began
        self._releasing = threading.Condition()  # guards the two fields below
        self._unreleased = 0  # Release calls queued or in flight, not waited for

    def _call(self, name: str, fn, *args, timeout_s: float | None = None):
        """``fn(*args, timeout=...)``; gRPC has made every attempt the channel allows."""
        timeout = timeout_s if timeout_s is not None else self.options.timeout_s
        if self._local is not None and name in LOCAL_METHODS:
            t0 = time.monotonic()
            try:
                reply = self._local.call(name, args[0], timeout)
            except LocalCallError as exc:
                raise ClientError(name, exc.code, exc.details) from None
            if reply is not None:
                return reply
            if timeout is not None:  # gRPC gets what is left of the call's time
                timeout = max(0.001, timeout - (time.monotonic() - t0))
        try:
            return fn(*args, timeout=timeout)
        except grpc.RpcError as exc:
            raise ClientError(name, exc.code(), exc.details() or "") from None

    def lookup(
        self,
        keys: Sequence[bytes],
        lease_ttl_s: float = 0.0,
        timeout_s: float | None = None,
        *,
        reserve_ttl_s: float = 0.0,
        holder: str = "",
        shm: bool = False,
    ) -> LookupResult:
        """The stored prefix; with ``reserve_ttl_s``, single-flight: the missing rest is
        reserved to ``holder`` (``reserved``) unless another producer is computing it
        (``pending``: wait for its puts). With a lease and ``shm``, a store on this host
        also says where the leading leased chunks lie in its shared memory (``shm``, a
        ``ShmGrant`` for ``shm_views``, here or in another process of this host)."""
        req = pb.LookupRequest(
            keys=keys,
            lease_ttl_s=lease_ttl_s,
            reserve_ttl_s=reserve_ttl_s,
            holder=holder,
            shm=shm and lease_ttl_s > 0,
        )
        sent = time.monotonic()
        # a retried leased lookup could leave a second lease behind; it just expires
        resp = self._call("Lookup", self._lookup, req, timeout_s=timeout_s)
        return _lookup_result(resp, sent)

    def get(
        self, keys: Sequence[bytes], *, shm: bool = False, timeout_s: float | None = None
    ) -> list[memoryview]:
        """Payloads of the longest stored prefix of ``keys``.

        With ``shm`` (same host only) DRAM chunks are copied out of the store's
        shared memory under a lease that is released before returning.
        """
        if not shm:
            return self._get_bytes(keys, timeout_s)
        out: dict[int, memoryview] = {}

        def copy(i: int, src: memoryview) -> None:
            out[i] = memoryview(bytearray(src))

        n = self._shm_copy(keys, copy, timeout_s)
        return [out[i] for i in range(n)]

    def _get_bytes(self, keys: Sequence[bytes], timeout_s: float | None) -> list[memoryview]:
        req = pb.GetRequest(keys=keys)
        messages = self._call(
            "Get", lambda r, timeout: list(self._get(r, timeout=timeout)), req, timeout_s=timeout_s
        )
        return _decode_get(messages)

    def _shm_copy(self, keys: Sequence[bytes], copy, timeout_s: float | None) -> int:
        """``copy(i, view)`` each chunk of the stored prefix; returns how many hold good bytes.

        Chunks in shared memory are copied under the batch's lease, which is then
        released. A copy stands only if the store still held the lease at release
        and the slot still holds the chunk's key (``ShmReader``); the others, and
        the rest of the prefix (not in shared memory), come from ``Get``. If
        ``Get`` finds fewer chunks than that, the count stops at the first chunk
        without good bytes.
        """
        batch, sent = self._get_shm_leased(keys, timeout_s)
        handles = batch.handles
        try:
            bad = self._shm.copy_out(keys, handles, copy)
        finally:
            held = self._end_lease(batch, sent) if handles else True
        self._shm.stats.count(len(handles), len(handles) - len(bad), held)
        if not held:
            bad = set(range(len(handles)))
        good = [i not in bad for i in range(len(handles))]
        good += [False] * (batch.matched - len(handles))
        if not all(good):
            rest = self._get_bytes(keys[: batch.matched], timeout_s)
            for i in range(len(rest)):
                if not good[i]:
                    copy(i, rest[i])
                    good[i] = True
        return good.index(False) if False in good else len(good)

    def _get_shm_leased(
        self, keys: Sequence[bytes], timeout_s: float | None
    ) -> tuple[pb.ShmBatch, float]:
        """GetShm under this client's lease ttl; the answer and when it was sent."""
        ttl = self.options.shm_lease_ttl_s or 0.0
        req = pb.GetShmRequest(keys=keys, lease_ttl_s=ttl)
        sent = time.monotonic()
        return self._call("GetShm", self._get_shm, req, timeout_s=timeout_s), sent

    def _end_lease(self, batch: pb.ShmBatch, sent: float) -> bool:
        """Release a GetShm lease; False unless the store surely held it until now.

        The store granted the lease after ``sent`` and keeps its bytes for
        ``batch.lease_ttl_s`` from then, on this host's monotonic clock (shared memory
        is same-host only). A copy that ended within half of that needs no answer: the
        release is sent without waiting, saving a round trip per read. Otherwise (a slow
        copy, or a store that does not say its lease's length) the store's answer
        decides: NOT_FOUND means the lease expired, so the slots may have been reused.
        """
        if not batch.lease_id:
            return False
        if time.monotonic() - sent < batch.lease_ttl_s * LEASE_TRUSTED_FRACTION:
            self.release_later(batch.lease_id)
            return True
        try:
            self.release(batch.lease_id)
        except ClientError:
            return False  # expired (NOT_FOUND), or unknown
        return True

    def release_later(self, lease_id: int) -> None:
        """Release from this client's background thread, never waiting (a gRPC future
        starts a thread per call); an error only lets the lease lapse at its ttl.
        ``stats`` and ``close`` wait until the ones queued have been sent."""
        with self._releasing:
            if self._closing:
                return  # closed: the lease lapses at its ttl
            self._unreleased += 1
            if self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_loop, daemon=True, name="kvstore-release"
                )
                self._releaser.start()
        self._release_queue.put(lease_id)

    def _release_loop(self) -> None:
        while (lease_id := self._release_queue.get()) is not None:
            try:
                with contextlib.suppress(Exception):  # e.g. ValueError: channel closed
                    # an error only means the lease lapses on its own
                    req = pb.ReleaseRequest(lease_id=lease_id)
                    self._release(req, timeout=self.options.timeout_s)
            finally:
                with self._releasing:
                    self._unreleased -= 1
                    self._releasing.notify_all()

    def wait_releases(self, timeout_s: float | None = None) -> bool:
        """Until every ``release_later`` was sent (at most ``timeout_s``, by default the
        client's timeout); False if some were still queued."""
        timeout_s = self.options.timeout_s if timeout_s is None else timeout_s
        with self._releasing:
            return self._releasing.wait_for(lambda: self._unreleased == 0, timeout_s)

    @property
    def shm_stats(self) -> ShmReadStats:
        """Chunks this client took from shared memory, and why others came over TCP."""
        return self._shm.stats

    def shm_views(
        self,
        keys: Sequence[bytes],
        timeout_s: float | None = None,
        grant: ShmGrant | None = None,
    ) -> ShmViews | None:
        """The stored prefix of ``keys`` as views straight into the store's shared memory,
        under a lease, nothing copied: for a reader that uses each byte once (decoding or
        scattering it) and can take back what it did. None when any chunk of the prefix is
        not in shared memory in one piece (nothing leased then): read it another way.

        The views must be treated as read-only, and trusted only for the leading chunks
        ``ShmViews.end()`` counts once the caller is done with them.

        With ``grant`` (a leased lookup's ``shm``, made here or by another process of
        this host), the caller takes over that lookup's lease: it is this call's to end,
        used or not. A grant that covers every key and is fresh saves the GetShm: the
        views lie under its lease, which ``end`` releases as it would GetShm's.
        """
        if grant is not None:
            got = self._granted_views(keys, grant)
            if got is not None:
                return got
            self.release_later(grant.lease_id)  # passed over: the GetShm below leases anew
        batch, sent = self._get_shm_leased(keys, timeout_s)
        got = None
        if batch.matched and len(batch.handles) == batch.matched:
            got = self._shm.views(keys, batch.handles)
        if got is None:
            if batch.lease_id:
                self._end_lease(batch, sent)
            return ShmViews(self, batch, sent, keys, None, []) if not batch.matched else None
        return ShmViews(self, batch, sent, keys, *got)

    def _granted_views(self, keys: Sequence[bytes], grant: ShmGrant) -> ShmViews | None:
        fresh = time.monotonic() - grant.sent < grant.lease_ttl_s * GRANT_FRESH_FRACTION
        if fresh and len(grant.handles) >= len(keys) > 0:
            batch = pb.ShmBatch(
                matched=len(keys),
                lease_id=grant.lease_id,
                handles=[
                    pb.ShmHandle(region=r, offset=o, length=n)
                    for r, o, n in grant.handles[: len(keys)]
                ],
                lease_ttl_s=grant.lease_ttl_s,
            )
            got = self._shm.views(keys, batch.handles)
            if got is not None:
                self._shm.stats.grants_used += 1
                return ShmViews(self, batch, grant.sent, keys, *got)
        self._shm.stats.grants_unused += 1
        return None

    def get_shm_into(
        self, keys: Sequence[bytes], dests: Sequence, timeout_s: float | None = None
    ) -> int:
        """Copy the stored prefix of ``keys`` into ``dests``, one per key.

        ``dests`` are writable buffers or contiguous CPU torch tensors (any dtype).

        Returns how many chunks were copied. Uses shared memory for DRAM chunks.
        """
        into = copiers(dests)

        def copy(i: int, src: memoryview) -> None:
            into[i](src)

        return self._shm_copy(keys[: len(into)], copy, timeout_s)

    def put(
        self, records: Sequence[ChunkRecord], timeout_s: float | None = None, *, shm: bool = False
    ) -> PutResult:
        """Store chunks, parents first. With ``shm`` (same host only) the payloads are
        copied straight into the store's shared memory (``kvstore.client.shm_writer``), or
        written there by a record that is a ``shm_writer.Fill``; without, a ``Fill`` writes
        its payload into a buffer first.

        Otherwise they go to the store's put process when it has one, and to the store
        itself when it has none or the put process cannot be reached; all within one
        deadline, ``timeout_s``."""
        if shm:
            from kvstore.client.shm_writer import put_same_host

            return put_same_host(self, records, timeout_s)
        if not all(isinstance(r, ChunkRecord) for r in records):
            from kvstore.client.shm_writer import for_wire

            records, refused = for_wire(records)
            result = self.put(records, timeout_s) if records else PutResult(0, 0, [])
            return PutResult(result.stored, result.duplicates, refused + result.rejected)
        batches = _batches(records, self.options.put_batch_bytes)
        timeout = timeout_s if timeout_s is not None else self.options.timeout_s
        deadline = time.monotonic() + timeout

        def send(put):
            def call(b, timeout):
                o = self.options
                return put(_encoded(b, o.put_part_bytes, o.put_split_bytes), timeout=timeout)

            left = max(0.0, deadline - time.monotonic())
            return self._call("Put", call, batches, timeout_s=left)

        routes = self._routes
        route = routes.route(timeout) if routes is not None else None
        if routes is not None and route is not None:
            port, put = route
            try:
                return _put_result(send(put))
            except ClientError as exc:
                if exc.code not in FALLBACK:
                    raise
                # the put process is down or gone: the store takes the whole put (stored
                # keys come back as duplicates), and the next puts, until it is asked again
                routes.failed(port)
        # Put is idempotent (a stored key is a duplicate): a retry re-sends every batch.
        return _put_result(send(self._put))

    def release(self, lease_id: int, timeout_s: float | None = None) -> None:
        self._call(
            "Release", self._release, pb.ReleaseRequest(lease_id=lease_id), timeout_s=timeout_s
        )

    def delete(
        self,
        keys: Sequence[bytes] = (),
        namespace: bytes | None = None,
        timeout_s: float | None = None,
    ) -> int:
        req = pb.DeleteRequest(keys=keys, namespace=namespace or b"")
        return self._call("Delete", self._delete, req, timeout_s=timeout_s).removed

    def stats(self, timeout_s: float | None = None) -> pb.StatsResponse:
        self.wait_releases()  # so the figures count this client's own ended leases
        return self._call("Stats", self._stats, pb.StatsRequest(), timeout_s=timeout_s)

    def explain(
        self,
        keys: Sequence[bytes],
        namespace: bytes | None = None,
        lease_id: int | None = None,
        timeout_s: float | None = None,
    ) -> pb.ExplainResponse:
        req = pb.ExplainRequest(keys=keys, namespace=namespace or b"", lease_id=lease_id or 0)
        return self._call("Explain", self._explain, req, timeout_s=timeout_s)

    def ping(self, timeout_s: float | None = None) -> bool:
        """True when the server's health service says the store is SERVING."""
        req = health_pb2.HealthCheckRequest(service=SERVICE)
        resp = self._call("Health", self._health.Check, req, timeout_s=timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.wait_releases()
        with self._releasing:
            self._closing = True
        if self._releaser is not None:
            self._release_queue.put(None)
        self._shm.close()
        from kvstore.client.shm_writer import close_region

        close_region(self)
        if self._routes is not None:
            self._routes.close()
        if self._local is not None:
            self._local.close()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncKVStoreClient:
    """The asyncio twin of ``KVStoreClient`` (bytes only, no shared memory). Its puts
    always go to the store itself, never to a put process (``Routes`` is not asked)."""

    def __init__(self, target: str, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        auth = self.options.auth or ClientAuth.from_env()
        self._channel = auth.aio_channel(target, _channel_options(self.options))
        ch = self._channel
        self._lookup = ch.unary_unary(
            _method("Lookup"), pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
        )
        self._get = ch.unary_stream(_method("Get"), pb.GetRequest.SerializeToString, None)
        self._put = ch.stream_unary(_method("Put"), None, pb.PutResponse.FromString)
        self._release = ch.unary_unary(
            _method("Release"), pb.ReleaseRequest.SerializeToString, pb.ReleaseResponse.FromString
        )
        self._stats = ch.unary_unary(
            _method("Stats"), pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString
        )

    async def _call(self, name: str, coro_fn, timeout_s: float | None):
        """``await coro_fn(timeout)``; gRPC has made every attempt the channel allows."""
        timeout = timeout_s if timeout_s is not None else self.options.timeout_s
        try:
            return await coro_fn(timeout)
        except grpc.aio.AioRpcError as exc:
            raise ClientError(name, exc.code(), exc.details() or "") from None

    async def lookup(
        self, keys: Sequence[bytes], lease_ttl_s: float = 0.0, timeout_s: float | None = None
    ) -> LookupResult:
        req = pb.LookupRequest(keys=keys, lease_ttl_s=lease_ttl_s)
        resp = await self._call("Lookup", lambda t: self._lookup(req, timeout=t), timeout_s)
        return _lookup_result(resp)

    async def get(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[memoryview]:
        req = pb.GetRequest(keys=keys)

        async def run(t):
            return [m async for m in self._get(req, timeout=t)]

        messages = await self._call("Get", run, timeout_s)
        return _decode_get(messages)

    async def put(
        self, records: Sequence[ChunkRecord], timeout_s: float | None = None
    ) -> PutResult:
        if not all(isinstance(r, ChunkRecord) for r in records):  # shm_writer.Fill records
            from kvstore.client.shm_writer import for_wire

            records, refused = for_wire(records)
            result = await self.put(records, timeout_s) if records else PutResult(0, 0, [])
            return PutResult(result.stored, result.duplicates, refused + result.rejected)
        batches = _batches(records, self.options.put_batch_bytes)
        resp = await self._call(
            "Put",
            lambda t: self._put(
                _encoded(batches, self.options.put_part_bytes, self.options.put_split_bytes),
                timeout=t,
            ),
            timeout_s,
        )
        return _put_result(resp)

    async def release(self, lease_id: int, timeout_s: float | None = None) -> None:
        req = pb.ReleaseRequest(lease_id=lease_id)
        await self._call("Release", lambda t: self._release(req, timeout=t), timeout_s)

    async def stats(self, timeout_s: float | None = None) -> pb.StatsResponse:
        return await self._call(
            "Stats", lambda t: self._stats(pb.StatsRequest(), timeout=t), timeout_s
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
