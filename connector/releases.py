"""Ending leases off the scheduler's thread.

Offers ``Releases(client_fn)`` with ``release(lease_ids)``, ``flush(timeout_s)`` and
``close()``. A ``Release`` is a store round trip; the scheduler half ends leases in the
step a request finishes, which vLLM runs before that step's tokens go out, so a
synchronous Release added its round trip to the time to first token of every
``max_tokens=1`` request and to every running request's inter-token gap. One daemon
thread sends them in order instead. A Release that fails or never runs costs nothing
but time: the store drops a lease when its ttl ends.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable


class Releases:
    def __init__(self, client_fn: Callable[[], object]) -> None:
        self._client_fn = client_fn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done = threading.Condition()
        self._pending = 0  # queued or being sent

    def release(self, lease_ids: Iterable[int]) -> None:
        ids = list(lease_ids)
        if not ids:
            return
        with self._done:
            self._pending += len(ids)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="kvstore-lease-end"
                )
                self._thread.start()
        for lease_id in ids:
            self._queue.put(lease_id)

    def _loop(self) -> None:
        while True:
            lease_id = self._queue.get()
            if lease_id is None:
                return
            with contextlib.suppress(Exception):  # otherwise the lease simply expires
                self._client_fn().release(lease_id)
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued Release was sent; False if ``timeout_s`` ran out."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (bounded by ``timeout_s``), then stop the thread."""
        if self._thread is None:
            return
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)
