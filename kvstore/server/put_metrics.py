"""The put process's metrics, counted on the store's ``/metrics``.

The put process serves ``Put`` with the store's own ``KVStoreService``, whose calls,
refusals and wire bytes the store's ``Metrics`` counts for the calls it serves itself.
Offers:

- ``MetricsRelay(send)``, put process side: stands in for ``Metrics`` behind that
  service (``observe_rpc``, ``rejected``, ``bytes_transferred``, ``watch_puts``), and
  counts the chunks ``ForwardingStore`` refuses before they reach the store
  (``chunk_refused``). At the end of every call it sends what it gathered, with the
  bytes of its idle part buffers, over the private channel (one more round trip per
  call, ~0.1 ms): before gRPC answers the client, so a client that has its answer finds
  the call on the store's ``/metrics``.
- ``Relayed(metrics, store)``, store side: adds what arrives to the store's ``Metrics``
  (the same families, plus ``kvstore_put_process_calls_total``) and the refused chunks
  to the store's own refusals (``kvstore_store_rejected_total``, ``kvstore stats``);
  holds the running put process's latest pooled bytes, added to the store's own, until
  it exits (``started``/``ended``: a late report of a dead one sets nothing).

Not relayed: the put process's bytes in flight (``kvstore_put_inflight_bytes`` is the
store process's own); read when a call ends, they would be the other calls' bytes at that
moment, never a stream's own. What a put process had gathered when it was killed is lost:
at most the calls it was serving then.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("kvstore.put_process")


class MetricsRelay:
    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._seq = 0
        self._pooled: Callable[[], float] = lambda: 0.0
        self._pending = self._fresh()

    @staticmethod
    def _fresh() -> dict:
        return {"calls": [], "rejected": Counter(), "wire": Counter(), "refused": Counter()}

    def watch_puts(self, inflight_fn: Callable[[], float], pooled_fn: Callable[[], float]) -> None:
        """Only the pooled part buffers are relayed: read when a call ends, the bytes in
        flight would be the other calls' at that moment, never a stream's own."""
        self._pooled = pooled_fn

    def rejected(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._pending["rejected"][reason] += n

    def bytes_transferred(self, direction: str, n: int) -> None:
        with self._lock:
            self._pending["wire"][direction] += n

    def chunk_refused(self, code: str) -> None:
        with self._lock:
            self._pending["refused"][code] += 1

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        """A call ended: send it, and whatever else was gathered since the last send."""
        with self._lock:
            self._pending["calls"].append((method, seconds, code))
            batch, self._pending = self._pending, self._fresh()
            self._seq += 1
            batch["seq"] = self._seq
            batch["pooled"] = float(self._pooled())
        try:
            self._send(batch)
        except Exception as exc:  # never fails (or changes the answer of) the call it reports
            log.warning("could not report a call's metrics to the store: %r", exc)


class Relayed:
    def __init__(self, metrics, store) -> None:
        self.metrics, self.store = metrics, store
        self._lock = threading.Lock()
        self._generation: int | None = None  # the put process running now
        self._seq = 0
        self._pooled = 0.0
        metrics.watch_puts(lambda: 0.0, lambda: self._pooled)

    def started(self, generation: int) -> None:
        """A put process of that generation starts: its reports count, from seq 1."""
        with self._lock:
            self._generation, self._seq, self._pooled = generation, 0, 0.0

    def ended(self) -> None:
        """The put process exited: it holds nothing any more, and a report of its that
        arrives late still counts its calls but sets no gauge."""
        with self._lock:
            self._generation, self._seq, self._pooled = None, 0, 0.0

    def apply(self, batch: dict, generation: int) -> None:
        """Count a batch from the put process of ``generation``."""
        m = self.metrics
        for method, seconds, code in batch["calls"]:
            m.observe_rpc(method, seconds, code)
            m.put_process_call(code)
        for reason, n in batch["rejected"].items():
            m.rejected(reason, n)
        for direction, n in batch["wire"].items():
            m.bytes_transferred(direction, n)
        for code, n in batch["refused"].items():
            self.store.count_rejected(code, n)
        with self._lock:  # calls that end together may arrive out of order
            if generation == self._generation and batch["seq"] > self._seq:
                self._seq, self._pooled = batch["seq"], batch["pooled"]
