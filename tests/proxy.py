"""A loopback TCP proxy whose traffic a test can slow down or hold back, to stand in
for a slow or black-holed network path to the store.

Offers ``FaultyProxy(target_port)`` with ``port`` and ``mode``: ``"pass"`` forwards
at once; ``"delay"`` forwards each read after ``delay_s``; ``"stall"`` accepts
connections and bytes but forwards nothing until the mode changes (a black hole
that heals: held bytes then go on, as after a network partition). ``close()``
ends it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FaultyProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay_s = 0.0
        self._mode = "pass"
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        assert value in ("pass", "delay", "stall"), value
        with self._changed:
            self._mode = value
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the store is down: so is the path to it
                continue
            upstream.settimeout(None)
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._changed:
                    self._changed.wait_for(lambda: self._mode != "stall" or self._closed)
                    if self._mode == "delay":  # a switch back to "pass" ends the wait
                        self._changed.wait_for(lambda: self._mode != "delay", self.delay_s)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.mode = "pass"
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
