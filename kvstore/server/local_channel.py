"""The store's same-host socket: ``ReserveShm``, ``CommitShm``, ``Lookup`` and ``GetShm``
without gRPC.

Offers ``LocalChannel(service)`` with ``start()``, ``stop(grace_s)``, ``address`` (an
abstract Unix socket's name, which ``Routes`` hands to clients) and ``calls`` (answered
calls per method). Framing and the reason it exists: ``kvstore.rpc.local_wire``.

Each call goes to the very servicer method gRPC calls (``KVStoreService.ReserveShm``...),
with a context that says the peer is local and carries the token of the client's hello:
authentication, tenants, quotas, draining, metrics and error codes are the same as over
gRPC. Who may connect: a process of the store's own user, or root; they can map the
store's shared memory anyway. Anyone else is hung up on before a byte is read or sent.
A hello is answered (``OK``) before any call, so a client over the limit of
``MAX_CLIENTS`` connections, or one that reached a stopping store, is told so
(``UNAVAILABLE``) before it sends a call, and uses gRPC. A client that sends a frame no
client sends (over the size limit, cut short, not finished ``FRAME_TIMEOUT_S`` after it
began, no hello within ``HELLO_TIMEOUT_S``) is hung up on; one that names no method this
socket serves, or sends a request that does not parse, is told so and may go on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter

import grpc

from kvstore.rpc.local_wire import (
    HELLO,
    METHODS,
    FrameError,
    peer_allowed,
    peer_uid,
    recv_frame,
    send_frame,
)
from kvstore.server.service_handlers import checked, request_parser

log = logging.getLogger(__name__)
MAX_CLIENTS = 64
HELLO_TIMEOUT_S = 5.0  # a connection's hello must have come by then
FRAME_TIMEOUT_S = 30.0  # a frame's bytes must all have come this long after its first
LOCAL_PEER = "unix:kvstore-local"  # what the servicer sees as the caller's address


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the servicer asks of a gRPC context, for one local connection. Its peer is
    local, so to the quotas it is the same client as any caller of this host over gRPC
    (``service_calls.client_of``): a lease taken here and released over gRPC (or the
    other way round, after a fallback) ends in the same count."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def peer(self) -> str:
        return LOCAL_PEER

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> None:
        return None

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


class LocalChannel:
    def __init__(self, service) -> None:
        self.service = service
        self.address = "\0kvstore-local-" + os.urandom(8).hex()  # no file to leave behind
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(MAX_CLIENTS)
        self._lock = threading.Lock()  # guards the three below and calls
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self._closed = False  # past stop()'s grace: calls still running answer UNAVAILABLE
        self.calls: Counter[str] = Counter()
        # tag -> (method, parser, handler): gRPC's own pair, see service_handlers
        self._handlers = {
            tag: (name, request_parser(request), checked(service, getattr(service, name)))
            for tag, (name, request, _) in METHODS.items()
        }
        self._acceptor = threading.Thread(
            target=self._accept, name="kvstore-local-accept", daemon=True
        )

    def start(self) -> None:
        self._acceptor.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Take no more connections or calls; a call under way may finish within ``grace_s``,
        and one still running after that answers ``UNAVAILABLE``, not its result (the
        server closes the store next)."""
        with self._lock:
            self._stopping = True
            conns = dict(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)  # its reader wakes; an answer can still go out
        deadline = time.monotonic() + grace_s
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._closed = True
        self._acceptor.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed: stop() ran
            uid = peer_uid(conn)
            if not peer_allowed(uid):
                log.warning("refused a local connection from uid %d", uid)
                conn.close()  # not a byte read or sent
                continue
            with self._lock:
                full = self._stopping or len(self._conns) >= MAX_CLIENTS
                if not full:
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name="kvstore-local", daemon=True
                    )
                    self._conns[conn] = thread
                    thread.start()
                    continue
            with contextlib.suppress(OSError):  # told before its hello is read: use gRPC
                send_frame(conn, _code(grpc.StatusCode.UNAVAILABLE), b"too many local clients")
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            tag, body = recv_frame(conn, HELLO_TIMEOUT_S)
            if tag != HELLO:
                raise FrameError(f"the first frame must be a hello, not tag {tag}")
            context = _Context(body.decode("utf-8", "replace"))
            send_frame(conn, _code(grpc.StatusCode.OK), b"")
            while True:
                conn.settimeout(None)  # a connection may idle between calls
                tag, body = recv_frame(conn, FRAME_TIMEOUT_S)
                code, answer = self._answer(tag, body, context)
                with self._lock:
                    if self._closed:
                        code, answer = grpc.StatusCode.UNAVAILABLE, b"the store stopped"
                send_frame(conn, _code(code), answer)
        except (EOFError, OSError):
            pass  # the client went away (or stop() woke us)
        except FrameError as exc:
            log.info("hung up on a local client: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, tag: int, body: bytes, context: _Context) -> tuple[grpc.StatusCode, bytes]:
        if tag not in self._handlers:
            return grpc.StatusCode.UNIMPLEMENTED, f"no method has tag {tag} here".encode()
        name, parse, handle = self._handlers[tag]
        with self._lock:
            self.calls[name] += 1
        try:  # a request that does not parse is refused, and counted, as over gRPC
            response = handle(parse(body), context)
        except _Aborted as exc:
            return exc.code, exc.details.encode()
        return grpc.StatusCode.OK, response.SerializeToString()


def _code(code: grpc.StatusCode) -> int:
    return code.value[0]
