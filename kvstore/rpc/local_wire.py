"""The framing of the store's same-host socket (``kvstore.server.local_channel``).

A gRPC call between two processes of one host costs 0.4-1 ms on this project's machines,
most of it threads of gRPC's waking one another, and more the longer the store sat idle
before it (a store idle for 8 ms: 1.0 ms just for the request to reach the handler); the
same request over a Unix socket takes 0.03-0.1 ms. A same-host put makes two such calls
(``ReserveShm``, ``CommitShm``) and a same-host load at least one (``Lookup``, maybe
``GetShm``), so the store also answers those four on an abstract Unix socket, with the
same servicer, checks, metrics and errors as over gRPC.

Offers ``METHODS`` (the calls the socket serves, and their message types), ``HELLO``,
``MAX_FRAME``, ``send_frame``/``recv_frame`` and ``FrameError``.

A frame is a 5-byte header, ``<IB``: the body's length and a tag, then the body. A client
sends first a hello (tag ``HELLO``, the body its bearer token, maybe empty), then requests
(the tag names the method, the body is its protobuf request), one at a time; the store
answers each request with one frame whose tag is the gRPC status code's number and whose
body is the protobuf response (``OK``) or the error's message in UTF-8.
"""

from __future__ import annotations

import socket
import struct

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


class FrameError(Exception):
    """The peer went away mid-frame, or sent a frame no peer of this protocol sends."""


def send_frame(sock: socket.socket, tag: int, body: bytes) -> None:
    if len(body) > MAX_FRAME:
        raise FrameError(f"a frame of {len(body)} B is over the limit of {MAX_FRAME} B")
    sock.sendall(HEADER.pack(len(body), tag) + body)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """``(tag, body)``; ``EOFError`` when the peer closed between frames."""
    head = _recv_exact(sock, HEADER.size, between=True)
    length, tag = HEADER.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"a frame of {length} B is over the limit of {MAX_FRAME} B")
    return tag, _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, n: int, between: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            if between and got == 0:
                raise EOFError("the peer closed the socket")
            raise FrameError(f"the peer closed the socket {got} B into a {n} B read")
        got += k
    return bytes(buf)
