"""Where a client sends its puts: the store's put process, when the store has one.

Offers ``PutRoutes(target, channel, open_channel)``, ``put_target(target, port)`` and
``FALLBACK``. A store may run a put process, a child that serves only ``Put`` on a port of
its own so that a heavy put stream does not slow the store's lookups; the store says which
port (``Routes``, 0 when it has none). ``PutRoutes.route`` asks lazily and seldom: on the
first put, then at most every ``REASK_S`` while the store has no put port (it may start
one) or after a put could not reach it (``failed``: it may be restarting or have moved).
Any failure to answer, ``UNIMPLEMENTED`` from a store older than ``Routes`` included,
means "no put port": puts then go to the store's own ``Put``, as before. One channel per
put port, made by ``open_channel`` exactly like the client's own (TLS, token, options).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from kvstore.rpc.pb import SERVICE, pb

# How long an answer of "no put port" (or a put port that failed) stands before the next
# put asks again; a put port that works is kept until it fails.
REASK_S = 10.0
# The longest a Routes question may hold up the put that asks it.
ASK_TIMEOUT_S = 2.0
# The longest a put waits for a first connection to the put port before going to the
# store instead (again at most once per REASK_S while the port stays unreachable).
CONNECT_WAIT_S = 0.5
# A routed Put that fails with these never reached a put process that could take it (down,
# restarting, gone, or a port that serves no Put): the client sends it to the store's own
# Put. A deadline is not among them: the put's time is spent either way.
FALLBACK = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED})


def put_target(target: str, port: int) -> str | None:
    """``target``'s host with ``port`` (``[::1]:7``, ``ipv4:10.0.0.1:7``); None where
    there is no host to take another port: a Unix socket, a list of addresses."""
    if target.startswith(("unix:", "unix-abstract:")) or "," in target:
        return None
    head, sep, tail = target.rpartition(":")
    host = head if sep and tail.isdigit() else target  # a target with no port keeps its host
    return f"{host}:{port}"


class PutRoutes:
    """One client's route for its puts; every method may be called from any thread.

    ``channel`` is the client's channel to the store (``Routes`` is asked there);
    ``open_channel(address)`` makes a channel to a put port.
    """

    def __init__(
        self,
        target: str,
        channel: grpc.Channel,
        open_channel: Callable[[str], grpc.Channel],
    ) -> None:
        self._target = target
        self._open_channel = open_channel
        self._routes = channel.unary_unary(
            f"/{SERVICE}/Routes",
            pb.RoutesRequest.SerializeToString,
            pb.RoutesResponse.FromString,
        )
        self._lock = threading.Lock()  # guards everything below
        self._port = 0
        self._next_ask = 0.0  # time.monotonic() from which a put may ask again
        self._asking = False  # one question at a time; puts meanwhile go to the store
        self._puts: dict[int, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}
        self._connected: set[int] = set()  # ports whose channel has been up since it failed
        self._closed = False

    def route(self, timeout_s: float) -> tuple[int, grpc.StreamUnaryMultiCallable] | None:
        """The put port and its ``Put``; None: send the put to the store itself. Asks the
        store first when its answer is due (for at most ``min(timeout_s, ASK_TIMEOUT_S)``)."""
        with self._lock:
            ask = not (self._port or self._asking) and time.monotonic() >= self._next_ask
            self._asking |= ask
        if ask:
            port = self._ask(min(timeout_s, ASK_TIMEOUT_S))
            with self._lock:
                self._port, self._asking = port, False
                self._next_ask = time.monotonic() + REASK_S
        with self._lock:
            port = self._port
            if not port or self._closed:
                return None
            if port not in self._puts:
                address = put_target(self._target, port)
                if address is None:  # PutRoutes is made only for targets that have one
                    return None
                ch = self._open_channel(address)
                put = ch.stream_unary(f"/{SERVICE}/Put", None, pb.PutResponse.FromString)
                self._puts[port] = (ch, put)
            ch, put = self._puts[port]
            if port in self._connected:
                return port, put
        # A put port nobody can reach (a firewall that drops, a port forward of the store's
        # port only) would hold a put in CONNECTING until its deadline, which is no reason
        # to fall back: route only over a connection that is up.
        try:
            grpc.channel_ready_future(ch).result(timeout=min(timeout_s, CONNECT_WAIT_S))
        except (grpc.FutureTimeoutError, ValueError):  # ValueError: closed meanwhile
            self.failed(port)
            return None
        with self._lock:
            self._connected.add(port)
        return port, put

    def failed(self, port: int) -> None:
        """A put could not reach ``port``: puts go to the store until the next question."""
        with self._lock:
            self._connected.discard(port)
            if self._port == port:
                self._port = 0
                self._next_ask = time.monotonic() + REASK_S

    def _ask(self, timeout_s: float) -> int:
        try:
            return self._routes(pb.RoutesRequest(), timeout=timeout_s).put_port
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
            return 0  # no answer, or a store older than Routes: no put port

    def close(self) -> None:
        """Close every put port's channel; later puts go to the store (or fail with it)."""
        with self._lock:
            self._closed = True
            puts, self._puts = self._puts, {}
        for ch, _ in puts.values():
            ch.close()
