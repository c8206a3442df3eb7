"""Two servers handed one port: ``tests.procs.free_port`` never hands a port out twice,
and ``OpenAIServer.wait_ready`` fails for a server whose port another process answers.

vLLM's API server binds its port with ``SO_REUSEADDR`` and listens only once its engine
is built, so two servers given one port both start; the first to listen answers
``/health`` for both. The stand-ins here are real processes that bind the way vLLM does:
one that never gets to listen (the server still building its engine) and one that
answers HTTP on the shared port.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.openai_server import OpenAIServer, ServerDied
from benchmarks.ports import listens_in
from tests import procs

STAND_IN = """
import http.server, socket, sys
port, serve = int(sys.argv[1]), sys.argv[2] == "serve"
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's create_server_socket
sock.bind(("127.0.0.1", port))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

if serve:
    server = http.server.HTTPServer(("127.0.0.1", port), Health, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()  # listen
print("bound", flush=True)
if serve:
    server.serve_forever()
else:
    sys.stdin.read()  # bound, never listening, until the test closes stdin
"""


def stand_in(port: int, serve: bool) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(port), "serve" if serve else "bind"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "bound\n"
    return proc


def as_server(name: str, proc: subprocess.Popen, port: int, log: Path) -> OpenAIServer:
    """An ``OpenAIServer`` for an already running stand-in (its constructor starts vLLM)."""
    log.write_text(f"{name}'s log\n")
    server = OpenAIServer.__new__(OpenAIServer)
    server.name, server.port, server.proc, server.log_path = name, port, proc, log
    return server


def test_a_server_whose_port_another_server_answers_is_not_ready(tmp_path):
    port = procs.free_port()
    building = stand_in(port, serve=False)  # handed the port first, still building
    other = stand_in(port, serve=True)  # handed the same port, listening first
    try:
        assert listens_in(other.pid, port) is True
        assert listens_in(building.pid, port) is False
        assert as_server("other", other, port, tmp_path / "other.log").wait_ready(10) >= 0
        with pytest.raises(ServerDied, match=f"port {port} is answered by another process"):
            as_server("building", building, port, tmp_path / "b.log").wait_ready(10)
    finally:
        for proc in (building, other):
            proc.kill()
            proc.wait()


def test_free_port_never_hands_a_port_out_twice(monkeypatch):
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    left = set(random.Random(0).sample(range(low, high + 1), 400))
    # every port of the kernel's range handed out already but 400: the kernel's picks
    # (at random over the range) are almost all ones handed out before
    monkeypatch.setattr(procs, "_HANDED_OUT", set(range(low, high + 1)) - left)
    got = [procs.free_port() for _ in range(20)]
    assert len(set(got)) == len(got)
    assert set(got) <= left
