"""The store's put process, store side: start it, answer it, restart it, clean up after it.

Offers ``PutProcess(store, spec, on_port)`` with ``start()`` and ``stop()``. The put
process (``python -m kvstore.server.put_worker``) serves ``Put`` on a port of its own,
so that the receipt, checksums, copies, compression and LMDB writes of a put stream run
outside the store's process and its lookups do not queue behind them (issue 9). It calls
back over a private channel (an abstract Unix socket, authenticated by a random key the
child reads from its stdin) for room (``reserve_shm``), to commit, to give
room back, for batches it cannot place, for a plain ``put``, and, at the end of every
call, with that call's metrics (``kvstore.server.put_metrics``), counted on the store's
``Metrics`` when one is given.

``on_port(port)`` hears the put process's gRPC port once it serves and ``None`` whenever
it stops; the service advertises it to clients (``Routes``), which fall back to the
store's own ``Put`` while there is none. A put process that exits is restarted (after
1 s, doubling up to 30 s while it keeps failing); everything it held is reclaimed first
(``TieredStore.reclaim_worker``), so a crash mid-chunk leaves no room taken and nothing
in LMDB that the index does not know. The child exits when its stdin closes, so it never
outlives the store, even one killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Listener

from kvstore.core.types import ChunkRecord, KVStoreError
from kvstore.server.put_metrics import Relayed
from kvstore.server.store import TieredStore

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0


class PutProcess:
    def __init__(
        self,
        store: TieredStore,
        spec: dict,
        on_port: Callable[[int | None], None],
        metrics=None,
    ) -> None:
        self.store = store
        # its calls, refusals and gauges, on the store's Metrics (put_metrics)
        self._relayed = Relayed(metrics, store) if metrics is not None else None
        self.spec = spec  # what the child needs: see put_worker.main
        self._on_port = on_port
        self._key = os.urandom(32)
        # an abstract socket: no file to leave behind; only a holder of the key gets in
        self._address = "\0kvstore-put-" + os.urandom(8).hex()
        self._listener = Listener(self._address, "AF_UNIX", authkey=self._key)
        self._live: int | None = None  # the generation now running
        self._generation = 0
        self._proc: subprocess.Popen | None = None
        self._proc_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, name="kvstore-put-channel", daemon=True),
            threading.Thread(target=self._supervise, name="kvstore-put-process", daemon=True),
        ]
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop the put process (its in-flight puts end), reclaim what it held."""
        with self._proc_lock:  # a child started from now on is ended by the supervisor
            self._stopping.set()
            proc = self._proc
        self._on_port(None)
        if proc is not None:
            _end(proc)
        self._threads[1].join(timeout=30)
        self._listener.close()

    # -- the child's life ---------------------------------------------------------------

    def _supervise(self) -> None:
        delay = 1.0
        while not self._stopping.is_set():
            self._generation += 1
            gen = self._live = self._generation
            if self._relayed is not None:
                self._relayed.started(gen)
            began = time.monotonic()
            rc: int | None = None
            try:
                proc = self._spawn(gen)
            except OSError:
                log.exception("cannot start the put process")
                proc = None
            if proc is not None:
                with self._proc_lock:
                    self._proc = proc
                    late = self._stopping.is_set()  # stop() ran while it started
                if late:
                    _end(proc)
                port = _read_port(proc)
                if port is not None and not self._stopping.is_set():
                    log.info("put process %d serves Put on port %d", proc.pid, port)
                    self._on_port(port)
                rc = proc.wait()
                self._on_port(None)
                for pipe in (proc.stdin, proc.stdout):
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._live = None
            if self._relayed is not None:
                self._relayed.ended()
            reclaimed = self.store.reclaim_worker(gen)
            if self._stopping.is_set():
                return
            self.restarts += 1
            if time.monotonic() - began > 60:
                delay = 1.0
            log.warning(
                "put process exited (%s); %d reservations reclaimed; restarting in %.0f s "
                "(puts go to the store itself meanwhile)",
                "could not start" if proc is None else f"code {rc}",
                reclaimed,
                delay,
            )
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _spawn(self, generation: int) -> subprocess.Popen:
        # the child imports this very kvstore, however this process found it
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server.put_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            # out of the store's process group: a Ctrl-C or a group-wide signal reaches
            # the store, which then ends the child's in-flight puts cleanly
            start_new_session=True,
        )
        spec = dict(self.spec, channel=self._address, authkey=self._key.hex())
        spec["generation"] = generation
        try:
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()  # and kept open: its end tells the child the store is gone
        except OSError:
            _end(proc)
            raise
        return proc

    # -- the channel ----------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed by stop()
                return
            except Exception:  # a caller without the key, say
                log.warning("refused a connection to the put channel", exc_info=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            try:
                hello, gen = conn.recv()
                if hello != "hello":
                    return
                while True:
                    message = conn.recv()
                    conn.send(self._answer(gen, message))
            except (EOFError, OSError):
                return

    def _answer(self, gen: int, message: tuple) -> tuple:
        store = self.store
        try:
            kind, *args = message
            if kind == "reserve":
                chunks, owner = args  # no ttl: the put process's room never lapses by time
                ticket, refs, stored = store.reserve_shm(chunks, 0.0, owner, worker=gen)
                if ticket is not None and self._live != gen:
                    store.reclaim_worker(gen)  # it died while we reserved: nobody will commit
                    raise KVStoreError("the put process is restarting")
                refs = [None if r is None else (r.region, r.offset, r.length) for r in refs]
                chain_ns = store.reserved_namespaces(ticket) if ticket is not None else {}
                return ("ok", (ticket, refs, stored, store.writes_through(), chain_ns))
            if kind == "commit":
                ticket, owner, persisted = args
                r = store.commit_shm(ticket, owner, worker=gen, persisted=persisted)
                return ("ok", (r.stored, r.duplicates, list(r.rejected)))
            if kind == "abort":
                ticket, written = args
                store.abort_shm(ticket, gen, written)
                return ("ok", None)
            if kind == "metrics":
                if self._relayed is not None:
                    self._relayed.apply(args[0], gen)
                return ("ok", None)
            if kind == "put":
                records, owner = args
                r = store.put([ChunkRecord(*rec) for rec in records], owner)
                return ("ok", (r.stored, r.duplicates, list(r.rejected)))
            return ("error", "InvalidArgument", f"unknown request {kind!r}")
        except KVStoreError as exc:
            return ("error", type(exc).__name__, str(exc))
        except Exception as exc:
            log.exception("put channel: %s failed", message[0] if message else "?")
            return ("error", "KVStoreError", f"internal error in the store: {exc}")


def _read_port(proc: subprocess.Popen) -> int | None:
    """The port the child reports once it serves; None if it died or never said."""
    result: list[int | None] = [None]

    def read() -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            result[0] = int(json.loads(proc.stdout.readline())["port"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if result[0] is None and proc.poll() is None:
        log.error("the put process did not report a port within %.0f s", START_TIMEOUT_S)
        _end(proc)
    return result[0]


def _end(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Close the child's stdin (it stops), and kill it if it has not within ``grace_s``."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
