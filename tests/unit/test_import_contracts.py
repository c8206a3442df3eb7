"""The import contracts in pyproject.toml (run by `make lint`) hold, and would catch a
client that imports the server: checked on a copy of the packages with one bad import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        timeout=120,
    )


def copy_tree(dest: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for pkg in ("kvstore", "connector"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_contracts_hold_on_this_tree(tmp_path):
    out = lint_imports(copy_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_client_that_imports_the_store_breaks_the_client_contract(tmp_path):
    tree = copy_tree(tmp_path)
    client = tree / "kvstore" / "client" / "grpc_client.py"
    text = client.read_text()
    head, sep, rest = text.partition("\nimport grpc\n")
    assert sep, "grpc_client.py no longer imports grpc where this test expects"
    client.write_text(head + sep + "from kvstore.server.store import TieredStore  # noqa\n" + rest)
    out = lint_imports(tree)
    assert out.returncode != 0
    assert "imports no server code BROKEN" in " ".join(out.stdout.split())
    assert "kvstore.client.grpc_client -> kvstore.server.store" in out.stdout
