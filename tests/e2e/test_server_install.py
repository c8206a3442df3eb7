"""A store host installs without torch: `pip install .` into a fresh venv, then
`kvstore serve` and `kvstore stats` from that venv against real traffic.

The package is copied as a release would ship it (the gRPC stubs included, which
`make proto` generates at install time) and installed non-editable, so nothing
of this checkout's venv can leak in. pip's cache makes a rerun take ~25 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from tests.chunks import chain
from tests.procs import ROOT, Served, store_config

pytestmark = pytest.mark.timeout(600)


def run(argv: list, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=540, **kw)


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory) -> Path:
    """A venv holding `pip install .` of this package and nothing else."""
    if not (ROOT / "kvstore" / "v1" / "kvstore_pb2.py").exists():
        pytest.fail("the gRPC stubs are missing: run `make proto` first")
    base = tmp_path_factory.mktemp("server-install")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("kvstore", "connector"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    installed = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(src)])
    assert installed.returncode == 0, installed.stderr[-4000:]
    return venv


def test_the_server_install_has_no_torch_and_its_imports_never_reach_for_it(server_venv):
    py = str(server_venv / "bin" / "python")
    assert run([py, "-c", "import torch"]).returncode != 0, "torch was installed"
    probe = (
        "import sys, kvstore, kvstore.server.app, kvstore.cli, kvstore.client, "
        "kvstore.server.factory; "
        "print(kvstore.__file__); print(sorted(m for m in sys.modules if 'torch' in m))"
    )
    out = run([py, "-c", probe], cwd=server_venv)
    assert out.returncode == 0, out.stderr
    where, torch_modules = out.stdout.splitlines()
    assert where.startswith(str(server_venv)), where  # the installed copy, not this checkout
    assert torch_modules == "[]"


def test_kvstore_serve_and_stats_run_from_the_server_install(server_venv, tmp_path):
    kvstore = str(server_venv / "bin" / "kvstore")
    config = store_config(tmp_path / "kvstore.yaml", tmp_path / "lmdb", dram="8MiB")
    served = Served([kvstore, "serve", "--config", str(config)], env={"PYTHONPATH": ""})
    try:
        records = chain(3)
        with KVStoreClient(served.address) as client:
            assert client.put(records).stored == 3
            assert client.lookup([r.key for r in records]).matched == 3
        out = run([kvstore, "stats", "--json", "--address", served.address])
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["chunks"] == "3"
        assert {t["name"]: t["chunks"] for t in stats["tiers"]} == {"dram": "3", "nvme": "3"}
        table = run([kvstore, "stats", "--address", served.address])
        assert table.returncode == 0 and "hit rate 100.0%" in table.stdout, table.stderr
    finally:
        code, err = served.stop()
    assert code == 0 and "Traceback" not in err, err
