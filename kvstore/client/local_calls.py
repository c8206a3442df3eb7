"""Same-host calls over the store's Unix socket instead of gRPC.

Offers ``LocalCalls(target, channel, token)`` with ``call(name, request, timeout_s)``,
``close()``, ``LocalCallError`` and ``LOCAL_METHODS``. A store that offers shared memory also
answers ``ReserveShm``, ``CommitShm``, ``Lookup`` and ``GetShm`` on an abstract Unix socket,
which it names in ``Routes`` (``kvstore.server.local_channel``; why:
``kvstore.rpc.local_wire``). The client asks ``Routes`` on the first such call (then at most
every ``REASK_S`` while the store names no socket, or after it could not be reached) and
keeps one connection per thread (and per process: a forked child never writes to its
parent's).

``call`` returns None where the call should go over gRPC instead: the target is not on
this host, the store names no socket, the connection cannot be made (another network
namespace; a store over its limit of connections or stopping, which says so in answer to
the hello; a listener of another user, which may have taken the name of a store that
stopped and is never sent the token), the request is over the socket's frame limit, or
the connection was gone before the answer came to a call gRPC would retry (``RESENT``: a
second lease or reservation only lapses). A ``CommitShm`` whose answer was lost is not
sent again (its ticket may be spent): ``UNAVAILABLE``, as from gRPC. A call interrupted
between its request and its answer (a timeout, an exception) ends its connection, so no
answer is ever read as another call's. The store's own refusals come back as
``LocalCallError`` with gRPC's status code and message.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref

import grpc

from kvstore.rpc.local_wire import (
    HELLO,
    MAX_FRAME,
    METHODS,
    TAGS,
    FrameError,
    FrameTimeout,
    on_this_host,
    peer_allowed,
    peer_uid,
    recv_frame,
    send_frame,
)
from kvstore.rpc.pb import SERVICE, pb

LOCAL_METHODS = frozenset(TAGS)  # the calls a store's socket answers
# those sent again over gRPC when their answer was lost (gRPC itself retries them): a
# second lease or room only lapses. CommitShm's ticket may be spent: never sent twice.
RESENT = frozenset({"ReserveShm", "Lookup", "GetShm"})
REASK_S = 10.0  # as kvstore.client.put_routes
ASK_TIMEOUT_S = 2.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LocalCallError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalCalls:
    def __init__(self, target: str, channel: grpc.Channel, token: str) -> None:
        self._enabled = on_this_host(target)
        self._token = token.encode()
        self._routes = channel.unary_unary(
            f"/{SERVICE}/Routes", pb.RoutesRequest.SerializeToString, pb.RoutesResponse.FromString
        )
        self._lock = threading.Lock()  # guards the fields below
        self._address = ""
        self._next_ask = 0.0
        self._asking = False
        self._closed = False
        self._mine = threading.local()  # this thread's (pid, address, socket)
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def call(self, name: str, request, timeout_s: float | None):
        """The store's answer to ``name`` over its socket, or None: use gRPC (with what is
        left of ``timeout_s``; None: no deadline)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        address = self._route(timeout_s) if self._enabled else ""
        if not address.startswith("\0"):  # only ever an abstract socket: never a file
            return None
        sock = self._socket(address, deadline)
        if sock is None:
            return None
        tag = TAGS[name]
        try:
            body = request.SerializeToString()
            if len(body) > MAX_FRAME:
                return None  # gRPC says what is wrong with so large a request
            sock.settimeout(_left(deadline))
            send_frame(sock, tag, body)
        except OSError:  # the store closed it (restarted, stopping): it read no request
            self._drop(sock, address)
            return None
        except BaseException:  # the request may be half sent: this connection is done
            self._drop(sock)
            raise
        try:
            code, body = recv_frame(sock, _left(deadline))
        except (TimeoutError, FrameTimeout):  # a late answer must not be read as the next
            self._drop(sock)  # call's: this connection is done
            raise LocalCallError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s} s"
            ) from None
        except (OSError, EOFError, FrameError) as exc:
            self._drop(sock, address)
            if name in RESENT:
                return None
            raise LocalCallError(
                grpc.StatusCode.UNAVAILABLE, f"the store's local socket closed: {exc}"
            ) from None
        except BaseException:  # interrupted: the answer may still come, on this connection
            self._drop(sock)
            raise
        if code != grpc.StatusCode.OK.value[0]:
            status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
            raise LocalCallError(status, body.decode("utf-8", "replace"))
        return METHODS[tag][2].FromString(body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = list(self._sockets)
        for sock in socks:
            sock.close()

    def _route(self, timeout_s: float | None) -> str:
        with self._lock:
            ask = not (self._address or self._asking) and time.monotonic() >= self._next_ask
            self._asking |= ask
        if ask:
            address = ""
            try:
                wait = ASK_TIMEOUT_S if timeout_s is None else min(timeout_s, ASK_TIMEOUT_S)
                address = self._routes(pb.RoutesRequest(), timeout=wait).local_socket
            except (grpc.RpcError, ValueError):  # no answer, an older store, a closed channel
                pass
            finally:  # whatever ended the question, the next one comes REASK_S later
                with self._lock:
                    self._address, self._asking = address, False
                    self._next_ask = time.monotonic() + REASK_S
        with self._lock:
            return "" if self._closed else self._address

    def _socket(self, address: str, deadline: float | None) -> socket.socket | None:
        """This thread's connection to ``address``, made, checked and greeted when it has
        none; None when the store cannot be reached that way (then calls use gRPC until
        the next ``Routes`` question)."""
        mine = getattr(self._mine, "conn", None)
        if mine is not None and mine[0] == os.getpid() and mine[1] == address:
            return mine[2]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            wait = _left(deadline)
            sock.settimeout(ASK_TIMEOUT_S if wait is None else min(wait, ASK_TIMEOUT_S))
            sock.connect(address)
            # whoever listens on that name now must be the store's user (or root): a name
            # let go by a store that stopped can be taken by anyone, who would get the token
            if not peer_allowed(peer_uid(sock)):
                raise ConnectionRefusedError("the socket is another user's")
            send_frame(sock, HELLO, self._token)
            code, _ = recv_frame(sock, sock.gettimeout())
            if code != grpc.StatusCode.OK.value[0]:  # too many clients, stopping: use gRPC
                raise ConnectionRefusedError("the store turned the connection down")
        except (OSError, EOFError, FrameError):
            sock.close()
            self._failed(address)
            return None
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                return None
            self._sockets.add(sock)
        self._mine.conn = (os.getpid(), address, sock)
        return sock

    def _drop(self, sock: socket.socket, failed: str = "") -> None:
        self._mine.conn = None
        with contextlib.suppress(OSError):
            sock.close()
        if failed:
            self._failed(failed)

    def _failed(self, address: str) -> None:
        """Calls go over gRPC until the next question."""
        with self._lock:
            if self._address == address:
                self._address = ""
                self._next_ask = time.monotonic() + REASK_S


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (at least a millisecond, so a timeout is never "none")."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())
