"""The README is a product surface: its config table must match what the server accepts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvstore.config import Config

README = Path(__file__).resolve().parents[2] / "README.md"


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


def test_the_readme_links_only_inside_the_repository():
    text = README.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    outside = [link for link in links if re.match(r"[a-z]+://", link)]
    assert outside == []
    root = README.parent
    for link in links:
        target = link.split("#")[0]
        if target:
            assert (root / target).exists(), f"README links to missing {target}"
