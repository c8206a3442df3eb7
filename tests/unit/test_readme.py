"""The README is a product surface: its config table must match what the server accepts, and
the docs link only to committed files inside the repository."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from kvstore.server.config import Config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def accepted_keys() -> set[str]:
    cfg = Config()
    return {
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, section.name))
    }


def test_the_config_table_lists_exactly_the_keys_the_server_accepts():
    rows = re.findall(
        r"^\| `([a-z_]+\.[a-z_]+)` \| (\w+) \| `[^`]*` \| `(KVSTORE_[A-Z_]+)` \|",
        README.read_text(),
        re.M,
    )
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)), "a key is listed twice"
    assert set(keys) == accepted_keys()
    for key, _, env in rows:
        assert env == "KVSTORE_" + key.replace(".", "_").upper()


def test_the_connector_table_lists_exactly_the_keys_the_connector_accepts():
    from connector.config import ConnectorConfig

    text = README.read_text()
    start = text.index("`kv_connector_extra_config` keys")
    table = text[start : text.index("\n\n", text.index("| key |", start))]
    keys = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert len(keys) == len(set(keys)), "a key is listed twice"
    assert set(keys) == {f.name for f in dataclasses.fields(ConnectorConfig)}


def tracked_files() -> set[str] | None:
    """Paths git tracks in this checkout, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.stdout.splitlines())


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md", "docs/architecture.md"])
def test_the_docs_link_only_to_committed_files_inside_the_repository(doc):
    path = ROOT / doc
    links = re.findall(r"\]\(([^)]+)\)", path.read_text())
    outside = [link for link in links if re.match(r"[a-z]+:", link)]
    assert outside == [], f"{doc} links outside the repository"
    tracked = tracked_files()
    for link in links:
        target = link.split("#")[0]
        if not target:
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc} links outside the repository: {link}"
        assert resolved.exists(), f"{doc} links to missing {target}"
        if tracked is not None:
            rel = resolved.relative_to(ROOT).as_posix()
            committed = rel in tracked or any(t.startswith(rel + "/") for t in tracked)
            assert committed, f"{doc} links to {target}, which git does not track"


def test_the_readme_links_to_the_architecture():
    assert "](docs/architecture.md)" in README.read_text()
