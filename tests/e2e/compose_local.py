"""docker-compose.yml's services as local processes, for tests/e2e/test_compose.py.

Offers ``services(variables)`` (the file's services with ``${VAR:-default}``s
interpolated as compose does), ``Local(name, spec, ports, volumes, logs)`` (one
service's command, entrypoint, environment and healthcheck with its exposed ports
remapped to the given loopback ports, service names and 0.0.0.0 to 127.0.0.1, named
volumes to folders; ``start``, ``healthy``, ``stop``) and ``start_in_order`` (each
service once its ``depends_on`` are healthy, as compose does).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.procs import ROOT

COMPOSE_FILE = ROOT / "docker-compose.yml"
# what this machine needs besides: no hub, the engine core in the server's process, and
# one reserved core whatever the connector (2 cores here)
LOCAL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}


_VAR = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")


def interpolate(value, variables: dict[str, str]):
    """Compose's interpolation of the forms the file uses: $$, ${V}, ${V:-d}, ${V-d}, $V."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        got = variables.get(name)
        if m.group(3) == ":-" and not got:
            return m.group(4)
        if m.group(3) == "-" and got is None:
            return m.group(4)
        return got or ""

    return _VAR.sub(one, value)


def services(variables: dict[str, str]) -> dict[str, dict]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text())["services"], variables)


class Local:
    """A compose service as a local process: ports, hosts and volumes remapped."""

    def __init__(self, name: str, spec: dict, ports: dict, volumes: Path, logs: Path) -> None:
        self.name, self.spec, self.ports = name, spec, ports
        self.volumes = {v.split(":")[1]: volumes / v.split(":")[0] for v in spec.get("volumes", [])}
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def port(self, container_port: int | str) -> int:
        return self.ports[self.name, str(container_port)]

    def remap(self, s: str) -> str:
        mine = set(self.spec.get("expose", []))

        def own(m: re.Match) -> str:
            return f"127.0.0.1:{self.port(m.group(2))}" if m.group(2) in mine else m.group(0)

        s = re.sub(r"\b(0\.0\.0\.0|127\.0\.0\.1|localhost):(\d+)\b", own, s)
        for (service, container_port), port in self.ports.items():
            s = re.sub(
                rf"(?<![\w.-]){re.escape(service)}:{container_port}\b", f"127.0.0.1:{port}", s
            )
        for target, path in self.volumes.items():
            s = s.replace(target, str(path))
        return "127.0.0.1" if s == "0.0.0.0" else s

    def remap_argv(self, argv: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(argv):
            if i and argv[i - 1].endswith("port") and arg in self.spec.get("expose", []):
                out.append(str(self.port(arg)))
            else:
                out.append(self.remap(arg))
        return out

    def env(self) -> dict[str, str]:
        # a key without a value passes the host's value through: none here
        env = self.spec.get("environment") or {}
        return {k: self.remap(str(v)) for k, v in env.items() if v is not None}

    def argv(self, argv: list[str]) -> list[str]:
        out = self.remap_argv(argv)
        exe = out[0]
        if exe in ("python", "python3"):
            out[0] = sys.executable
        else:
            out[0] = str(Path(sys.executable).parent / exe)
            assert Path(out[0]).exists(), f"{self.name}: {exe} is not installed"
        return out

    def start(self) -> None:
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **LOCAL_ENV, **self.env()}
        argv = self.argv([*self.spec.get("entrypoint", []), *self.spec["command"]])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        test = self.spec["healthcheck"]["test"]
        assert test[0] == "CMD", test
        with contextlib.suppress(subprocess.TimeoutExpired):
            return (
                subprocess.run(self.argv(test[1:]), capture_output=True, timeout=10).returncode == 0
            )
        return False

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s, then to whatever outlived it."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self._log.close()


def start_in_order(locals_: dict[str, Local], timeout: float = 420) -> None:
    """Start every service whose dependencies are healthy; wait for each to be healthy."""
    healthy: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(healthy) < len(locals_):
        for svc in locals_.values():
            deps = set(svc.spec.get("depends_on", {})) & set(locals_)
            if svc.proc is None and deps <= healthy:
                svc.start()
        for name, svc in locals_.items():
            if svc.proc is not None and name not in healthy and svc.healthy():
                healthy.add(name)
        if time.monotonic() > deadline:
            late = sorted(set(locals_) - healthy)
            raise TimeoutError(f"not healthy in {timeout:.0f}s: {late}\n{locals_[late[0]].tail()}")
        time.sleep(0.5)
