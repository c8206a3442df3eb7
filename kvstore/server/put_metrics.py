"""The put process's metrics, counted on the store's ``/metrics``.

The put process serves ``Put`` with the store's own ``KVStoreService``, whose calls,
refusals and wire bytes the store's ``Metrics`` counts for the calls it serves itself.
Offers:

- ``MetricsRelay(send)``, put process side: stands in for ``Metrics`` behind that
  service (``observe_rpc``, ``rejected``, ``bytes_transferred``, ``watch_puts``), and
  counts the chunks ``ForwardingStore`` refuses before they reach the store
  (``chunk_refused``). At the end of every call it sends what it gathered, with its
  gauges, over the private channel: before gRPC answers the client, so a client that has
  its answer finds the call on the store's ``/metrics``.
- ``Relayed(metrics, store)``, store side: adds what arrives to the store's ``Metrics``
  (the same families, plus ``kvstore_put_process_calls_total``) and the refused chunks
  to the store's own refusals (``kvstore_store_rejected_total``, ``kvstore stats``);
  holds the put process's latest gauges, added to the store's, until it exits.

What a put process had gathered when it was killed is lost: at most the calls it was
serving then.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from kvstore.core.types import KVStoreError

log = logging.getLogger("kvstore.put_process")


class MetricsRelay:
    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._seq = 0
        self._gauges: list[Callable[[], float]] = [lambda: 0.0, lambda: 0.0]
        self._pending = self._fresh()

    @staticmethod
    def _fresh() -> dict:
        return {"calls": [], "rejected": Counter(), "wire": Counter(), "refused": Counter()}

    def watch_puts(self, inflight_fn: Callable[[], float], pooled_fn: Callable[[], float]) -> None:
        self._gauges = [inflight_fn, pooled_fn]

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
            batch["inflight"], batch["pooled"] = (float(f()) for f in self._gauges)
        try:
            self._send(batch)
        except KVStoreError as exc:  # never fails the call it reports on
            log.warning("could not report a call's metrics to the store: %s", exc)


class Relayed:
    def __init__(self, metrics, store) -> None:
        self.metrics, self.store = metrics, store
        self._lock = threading.Lock()
        self._seq = 0
        self._inflight = self._pooled = 0.0
        metrics.watch_puts(lambda: self._inflight, lambda: self._pooled)

    def apply(self, batch: dict, live: bool = True) -> None:
        """Count a batch; its gauges only from the put process running now (``live``)."""
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
            if live and batch["seq"] > self._seq:
                self._seq = batch["seq"]
                self._inflight, self._pooled = batch["inflight"], batch["pooled"]

    def ended(self) -> None:
        """The put process exited: it holds nothing any more; a new one counts anew."""
        with self._lock:
            self._seq = 0
            self._inflight = self._pooled = 0.0
