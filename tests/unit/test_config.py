"""Config: embedded defaults, YAML < environment < overrides, and errors that name the key."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
import yaml

from kvstore.core.types import InvalidArgument
from kvstore.server.config import (
    Config,
    ConfigError,
    DramConfig,
    GiB,
    KiB,
    MiB,
    describe_options,
    format_size,
    load_config,
    parse_size,
)
from kvstore.server.config_cli import add_cli_flags, overrides_from_args


def write_yaml(tmp_path, doc: object) -> str:
    path = tmp_path / "kvstore.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def test_embedded_defaults_are_a_valid_localhost_store_with_dram_and_lmdb():
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.server.listen == "127.0.0.1:50051" and cfg.server.metrics_listen.endswith(":9400")
    assert cfg.server.max_message_bytes > cfg.server.max_chunk_bytes == 64 * MiB
    assert cfg.store.write_policy == "write_through" and cfg.store.eviction_policy == "lru"
    assert cfg.dram.enabled and cfg.dram.capacity_bytes == 2 * GiB
    assert cfg.dram.slot_bytes == 0  # deprecated and ignored
    assert cfg.nvme.enabled and cfg.nvme.path == "./data/lmdb" and cfg.nvme.map_size == 0
    assert not cfg.hbm.enabled


def test_sections_are_frozen_and_coerce_strings_when_built_directly():
    dram = DramConfig(capacity_bytes="1GiB", slot_bytes="64KiB", enabled="off")
    assert (dram.capacity_bytes, dram.slot_bytes, dram.enabled) == (GiB, 64 * KiB, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dram.capacity_bytes = 1  # type: ignore[misc]


def test_a_yaml_file_sets_values_and_leaves_the_rest_at_defaults(tmp_path):
    path = write_yaml(
        tmp_path,
        """
server:
  listen: 0.0.0.0:50051
  metrics_listen: ""
store:
  write_policy: write_back
  low_watermark: 0.5
dram:
  capacity_bytes: 512MiB
nvme:
  sync: yes
  map_size: 1073741824
hbm:
""",
    )
    cfg = load_config(path, env={})
    assert cfg.server.listen == "0.0.0.0:50051" and cfg.server.metrics_listen == ""
    assert cfg.store.write_policy == "write_back" and cfg.store.low_watermark == 0.5
    assert cfg.dram.capacity_bytes == 512 * MiB and cfg.dram.slot_bytes == DramConfig().slot_bytes
    assert cfg.nvme.sync is True and cfg.nvme.map_size == GiB


def test_kvstore_config_names_the_file_when_no_path_is_given(tmp_path):
    path = write_yaml(tmp_path, {"server": {"workers": 4}})
    assert load_config(env={"KVSTORE_CONFIG": path}).server.workers == 4


def test_environment_beats_yaml_and_overrides_beat_environment(tmp_path):
    path = write_yaml(tmp_path, {"dram": {"capacity_bytes": "512MiB"}, "server": {"workers": 4}})
    env = {
        "KVSTORE_DRAM_CAPACITY_BYTES": "1GiB",
        "KVSTORE_SERVER_LISTEN": "0.0.0.0:50051",
        "KVSTORE_NVME_ENABLED": "false",
        "KVSTORE_STORE_HIGH_WATERMARK": "0.9",
        "HOME": "/root",  # not ours: ignored
    }
    cfg = load_config(path, env=env)
    assert cfg.dram.capacity_bytes == GiB and cfg.server.workers == 4
    assert cfg.server.listen == "0.0.0.0:50051" and cfg.nvme.enabled is False
    assert cfg.store.high_watermark == 0.9

    cfg = load_config(
        path, env=env, overrides={"dram.capacity_bytes": 256 * MiB, "server.workers": "2"}
    )
    assert cfg.dram.capacity_bytes == 256 * MiB and cfg.server.workers == 2
    assert cfg.server.listen == "0.0.0.0:50051"


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("1", True), ("YES", True), (" on ", True)]
    + [("false", False), ("0", False), ("No", False), ("off", False)],
)
def test_booleans_accept_the_usual_spellings(text, value):
    assert load_config(env={"KVSTORE_SERVER_SHM": text}).server.shm is value


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("64KiB", 64 * KiB),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2gib", 2 * GiB),
        (" 8 Ki ", 8 * KiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("64k", 64_000),
        ("1TB", 10**12),
        ("1TiB", 1 << 40),
        ("10b", 10),
        ("0.5KiB", 512),
    ],
)
def test_sizes_take_binary_and_decimal_units(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "bad", ["", "lots", "GiB", "-1GiB", "1.5", "0.3KiB", "2 GiBs", "1e9", "1,024", True, 1.5, None]
)
def test_garbage_sizes_are_refused_with_the_key(bad):
    with pytest.raises(ConfigError, match=r"^dram\.capacity_bytes must be a") as e:
        parse_size(bad, "dram.capacity_bytes")
    assert e.value.key == "dram.capacity_bytes"


def test_format_size_is_the_exact_binary_spelling():
    assert [format_size(n) for n in (2 * GiB, 4 * MiB + 64 * KiB, 4096, 1000, 0)] == [
        "2GiB",
        "4160KiB",
        "4KiB",
        "1000",
        "0",
    ]
    assert all(parse_size(format_size(n)) == n for n in (65 * MiB, 3 * GiB, 12345))


BAD_VALUES = [
    ("dram.slot_bytes", -1, "dram.slot_bytes must not be negative, got -1"),
    (
        "store.write_policy",
        "sometimes",
        "store.write_policy must be one of write_through, write_back, none, got 'sometimes'",
    ),
    ("store.eviction_policy", "mru", "must be one of fifo, lru"),
    ("store.high_watermark", 1.5, "must be in (0, 1]"),
    ("store.low_watermark", 0.99, "must be in (0, store.high_watermark=0.95]"),
    ("store.low_watermark", 0, "must be in (0,"),
    ("store.lease_ttl_s", 0, "must be positive"),
    ("store.max_lease_ttl_s", 1, "must be at least store.lease_ttl_s"),
    ("store.lease_ttl_s", "soon", "must be a finite number"),
    ("server.grace_s", "nan", "must be a finite number"),
    ("server.grace_s", -1, "must not be negative"),
    ("server.listen", "localhost", "must be host:port or unix:PATH"),
    ("server.listen", "localhost:99999", "must be host:port"),
    ("server.metrics_listen", "unix:/tmp/m.sock", "must be host:port, or empty"),
    ("server.max_message_bytes", "64MiB", "must exceed server.max_chunk_bytes"),
    ("server.max_keys_per_request", 0, "must be positive"),
    ("server.workers", 0, "must be positive"),
    ("server.workers", "many", "must be an integer"),
    ("server.workers", 2.5, "must be an integer"),
    ("server.shm", "maybe", "must be true/false"),
    ("dram.capacity_bytes", "lots", "must be a size"),
    ("dram.capacity_bytes", "1KiB", "dram.capacity_bytes must be at least 65536 B"),
    ("nvme.path", "", "must not be empty"),
    ("nvme.path", 5, "must be a string"),
    ("nvme.map_size", -1, "must be 0 (fit the disk) or positive"),
    ("nvme.compression", "lz4", "must be one of zstd, none"),
    ("nvme.zstd_level", 23, "must be in 1..22"),
    ("nvme.zstd_level", 0, "must be in 1..22"),
    ("hbm.device", -1, "must not be negative"),
    ("hbm.slot_bytes", -1, "must not be negative"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_VALUES)
def test_every_kind_of_bad_value_names_its_key(key, value, message):
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={key: value})
    assert str(e.value).startswith(key) and message in str(e.value)
    assert e.value.key == key and isinstance(e.value, InvalidArgument)
    assert str(e.value).endswith("(from overrides)")


def test_errors_say_where_the_bad_value_came_from(tmp_path):
    with pytest.raises(ConfigError, match=r"\(from environment variable KVSTORE_DRAM_SLOT_BYTES\)"):
        load_config(env={"KVSTORE_DRAM_SLOT_BYTES": "huge"})
    path = write_yaml(tmp_path, {"nvme": {"zstd_level": 99}})
    with pytest.raises(ConfigError, match=rf"nvme\.zstd_level .*\(from {path}\)$"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("where", "fragment"),
    [
        ({"yaml": {"dram": {"capacty_bytes": 1}}}, "'dram.capacty_bytes' (from "),
        ({"env": {"KVSTORE_DRAM_CAPACTY_BYTES": "1"}}, "KVSTORE_DRAM_CAPACTY_BYTES"),
        ({"overrides": {"dram.capacty_bytes": 1}}, "(from overrides)"),
    ],
)
def test_an_unknown_key_lists_the_valid_keys_of_its_section(tmp_path, where, fragment):
    path = write_yaml(tmp_path, where["yaml"]) if "yaml" in where else None
    with pytest.raises(ConfigError) as e:
        load_config(path, env=where.get("env", {}), overrides=where.get("overrides"))
    msg = str(e.value)
    assert fragment in msg
    assert "valid keys of dram: enabled, capacity_bytes, slot_bytes" in msg
    assert "did you mean dram.capacity_bytes?" in msg


@pytest.mark.parametrize(
    ("env", "overrides"),
    [({"KVSTORE_CACHE_SIZE": "1"}, None), ({}, {"workers": 4}), ({}, {"cache.size": 1})],
)
def test_an_unknown_section_lists_the_valid_sections(env, overrides):
    with pytest.raises(ConfigError, match="valid sections: server, store, dram, nvme, hbm"):
        load_config(env=env, overrides=overrides)


def test_a_missing_or_malformed_yaml_file_is_named(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=f"config file {missing} does not exist"):
        load_config(missing, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(env={"KVSTORE_CONFIG": missing})
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(write_yaml(tmp_path, "dram: [1, 2"), env={})
    with pytest.raises(ConfigError, match="must map sections to mappings of keys"):
        load_config(write_yaml(tmp_path, "dram: 5"), env={})
    with pytest.raises(ConfigError, match="must map sections to mappings of keys"):
        load_config(write_yaml(tmp_path, "- dram"), env={})


def test_no_enabled_tier_is_an_error():
    with pytest.raises(ConfigError, match="no tier is enabled"):
        load_config(env={"KVSTORE_DRAM_ENABLED": "0", "KVSTORE_NVME_ENABLED": "off"})
    only_hbm = {"dram.enabled": False, "nvme.enabled": False, "hbm.enabled": True}
    assert load_config(env={}, overrides=only_hbm).hbm.enabled


def test_to_dict_loads_back_as_a_config_file(tmp_path):
    cfg = load_config(env={}, overrides={"dram.capacity_bytes": "1GiB", "hbm.enabled": True})
    assert load_config(write_yaml(tmp_path, cfg.to_dict()), env={}) == cfg


def test_describe_options_covers_every_field_with_its_default_and_help():
    rows = {row.key: row for row in describe_options()}
    fields = {
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory())
    }
    assert set(rows) == fields
    assert all(row.help for row in rows.values())
    key, kind, default, _ = rows["dram.capacity_bytes"]
    assert (key, kind, default) == ("dram.capacity_bytes", "size", "2GiB")
    assert rows["nvme.enabled"].default == "true" and rows["nvme.enabled"].type == "bool"
    assert rows["store.write_policy"].default == "write_through"


def test_cli_flags_round_trip_through_argparse_into_overrides(tmp_path):
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    path = write_yaml(tmp_path, {"server": {"workers": 4}})
    args = parser.parse_args(
        [
            "--config",
            path,
            "--dram.capacity-bytes",
            "1GiB",
            "--nvme.path",
            str(tmp_path / "db"),
            "--nvme.enabled",
            "false",
            "--hbm.enabled",
            "--server.grace-s=2.5",
        ]
    )
    overrides = overrides_from_args(args)
    assert overrides == {
        "dram.capacity_bytes": "1GiB",
        "nvme.path": str(tmp_path / "db"),
        "nvme.enabled": "false",
        "hbm.enabled": "true",
        "server.grace_s": "2.5",
    }
    cfg = load_config(args.config, env={}, overrides=overrides)
    assert cfg.dram.capacity_bytes == GiB and cfg.server.workers == 4
    assert not cfg.nvme.enabled and cfg.hbm.enabled and cfg.server.grace_s == 2.5
    assert overrides_from_args(parser.parse_args([])) == {}
    help_text = parser.format_help()
    assert "--dram.capacity-bytes SIZE" in help_text and "KVSTORE_DRAM_CAPACITY_BYTES" in help_text


def test_client_commands_never_load_the_config_or_pydantic():
    probe = (
        "import sys; from kvstore.cli import build_parser; "
        "build_parser(serve_flags=False).parse_args(['ping']); "
        "print(sorted(m for m in sys.modules "
        "if m.startswith(('kvstore.server.config', 'pydantic'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
