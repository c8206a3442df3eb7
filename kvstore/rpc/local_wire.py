"""The framing of the store's same-host socket (``kvstore.server.local_channel``).

A gRPC call between two processes of one host costs 0.4-1 ms on this project's machines,
most of it threads of gRPC's waking one another, and more the longer the store sat idle
before it (a store idle for 8 ms: 1.0 ms just for the request to reach the handler); the
same request over a Unix socket takes 0.03-0.1 ms. A same-host put makes two such calls
(``ReserveShm``, ``CommitShm``) and a same-host load at least one (``Lookup``, maybe
``GetShm``), so the store also answers those four on an abstract Unix socket, with the
same servicer, checks, metrics and errors as over gRPC.

Offers ``METHODS`` (the calls the socket serves, and their message types), ``TAGS``,
``HELLO``, ``MAX_FRAME``, ``send_frame``/``recv_frame``, ``FrameError``/``FrameTimeout`` and
``peer_uid``/``peer_allowed`` (who either end talks to) and ``on_this_host`` (whether an
address is this host's).

A frame is a 5-byte header, ``<IB``: the body's length and a tag, then the body. A client
sends first a hello (tag ``HELLO``, the body its bearer token, maybe empty) and waits for
the store's answer to it (``OK``, or a refusal such as ``UNAVAILABLE`` when it has too many
connections: then the client uses gRPC); then requests (the tag names the method, the body
is its protobuf request), one at a time. The store answers each request with one frame
whose tag is the gRPC status code's number and whose body is the protobuf response
(``OK``) or the error's message in UTF-8.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from kvstore.rpc.pb import pb

HEADER = struct.Struct("<IB")
HELLO = 0
# the largest body either side sends or takes: a ReserveShm for the most keys one request
# may name (65,536 x ~70 B) is ~5 MiB
MAX_FRAME = 16 << 20
# tag -> (method, request type, response type)
METHODS = {
    1: ("ReserveShm", pb.ReserveShmRequest, pb.ShmReservation),
    2: ("CommitShm", pb.CommitShmRequest, pb.PutResponse),
    3: ("Lookup", pb.LookupRequest, pb.LookupResponse),
    4: ("GetShm", pb.GetShmRequest, pb.ShmBatch),
}
TAGS = {name: tag for tag, (name, _, _) in METHODS.items()}
_PIECE = 1 << 20  # bytes read at a time
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(cred)[1]


def peer_allowed(uid: int) -> bool:
    """Both ends talk only to a process of their own user, or root: the store's peers may
    map its shared memory anyway, and a client sends its token only to such a store."""
    return uid in (os.geteuid(), 0)


def on_this_host(target: str) -> bool:
    """Whether one gRPC target, or the peer address gRPC gives a server (``ipv4:``,
    ``ipv6:[...]``, ``unix:``), names this host: a Unix socket, ``localhost`` or a loopback
    address, with or without a port (a name DNS resolves, ``dns:...``: assume not)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    if target.startswith("dns:") or "," in target:
        return False
    host = target.removeprefix("ipv4:").removeprefix("ipv6:")
    if host.startswith("["):  # [::1]:port
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:  # host:port (a bare IPv6 address has more colons)
        host = host.split(":")[0]
    return host in ("localhost", "::1") or host.startswith("127.")


class FrameError(Exception):
    """The peer went away mid-frame, or sent a frame no peer of this protocol sends."""


class FrameTimeout(FrameError):
    """The peer took longer than its deadline to finish a frame."""


def send_frame(sock: socket.socket, tag: int, body: bytes) -> None:
    """``FrameError`` (nothing sent) for a body over ``MAX_FRAME``."""
    if len(body) > MAX_FRAME:
        raise FrameError(f"a frame of {len(body)} B is over the limit of {MAX_FRAME} B")
    sock.sendall(HEADER.pack(len(body), tag) + body)


def recv_frame(sock: socket.socket, within_s: float | None = None) -> tuple[int, bytes]:
    """``(tag, body)``; ``EOFError`` when the peer closed between frames.

    Waits for a frame's first byte as the socket's own timeout says (none: for ever); the
    rest must come within ``within_s`` of it (``FrameError`` if not), so a peer that sends
    a frame a byte at a time cannot hold the reader past that. The body is read into a
    buffer that grows as bytes come, never sized by the header alone.
    """
    first = sock.recv(HEADER.size)  # as much of the header as has come: one call, mostly
    if not first:
        raise EOFError("the peer closed the socket")
    deadline = None if within_s is None else time.monotonic() + within_s
    head = first + _recv_exact(sock, HEADER.size - len(first), deadline)
    length, tag = HEADER.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"a frame of {length} B is over the limit of {MAX_FRAME} B")
    return tag, _recv_exact(sock, length, deadline)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameTimeout(f"a frame was {len(buf)} of {n} B short at its deadline")
            sock.settimeout(left)
        try:
            piece = sock.recv(min(n - len(buf), _PIECE))
        except TimeoutError:
            raise FrameTimeout(f"a frame was {len(buf)} of {n} B short at its deadline") from None
        if not piece:
            raise FrameError(f"the peer closed the socket {len(buf)} B into a {n} B read")
        buf += piece
    return bytes(buf)
