"""`kvstore serve` / `python server.py` as real subprocesses, driven by the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from tests.chunks import chain
from tests.procs import KVSTORE, Served


def write_config(tmp_path: Path, **extra: str) -> Path:
    cfg = tmp_path / "kvstore.yaml"
    lines = [
        "server:",
        "  listen: 127.0.0.1:0",
        "  metrics_listen: 127.0.0.1:0",
        "  grace_s: 5",
        "dram:",
        "  capacity_bytes: 4MiB",
        "nvme:",
        f"  path: {tmp_path / 'lmdb'}",
        "  map_size: 256MiB",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KVSTORE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_serve_stats_explain_metrics_and_graceful_stop(tmp_path):
    served = Served([KVSTORE, "serve", "--config", str(write_config(tmp_path))])
    try:
        assert cli("ping", "--address", served.address).stdout.strip().endswith("SERVING")
        records = chain(3)
        # served by the store's put process (tests/service/test_put_process.py), whose
        # calls the store's /metrics counts as its own; `serve` says it is up before that
        # child serves, and a put sent before then goes to the store itself
        deadline = time.monotonic() + 60
        while scrape(served.metrics_port).get(("kvstore_put_process_up", ())) != 1:
            assert time.monotonic() < deadline, "the put process never came up"
            time.sleep(0.05)
        with KVStoreClient(served.address) as client:
            assert client.put(records).stored == 3
            assert client.lookup([r.key for r in records]).matched == 3
        stats = json.loads(cli("stats", "--json", "--address", served.address).stdout)
        assert stats["chunks"] == "3"  # proto uint64 renders as a string in JSON
        assert {t["name"]: t["chunks"] for t in stats["tiers"]} == {"dram": "3", "nvme": "3"}
        table = cli("stats", "--address", served.address).stdout
        assert re.search(r"^dram\s+4\.0 MiB\s+97\.5 KiB\s+2\.4%\s+3\b", table, re.M), table
        assert "hit rate 100.0%" in table

        done = cli("explain", "--address", served.address, *[r.key.hex() for r in records])
        assert done.returncode == 0 and "3/3 chunks stored: complete" in done.stdout
        missing = cli("explain", "--address", served.address, records[0].key.hex(), "00" * 16)
        assert missing.returncode == 3 and "never_stored" in missing.stdout

        metrics = scrape(served.metrics_port)
        assert metrics[("kvstore_put_chunks_total", ())] == 3
        assert metrics[("kvstore_tier_chunks", (("tier", "dram"),))] == 3
        assert metrics[("kvstore_rpc_total", (("code", "OK"), ("method", "Put")))] == 1
        assert metrics[("kvstore_put_process_calls_total", (("code", "OK"),))] == 1
        assert metrics[("kvstore_lookup_hit_keys_total", ())] == 3
    finally:
        code, err = served.stop()
    assert code == 0, err
    assert "Traceback" not in err

    # the data survived a clean stop: `python server.py` on the same config finds it
    again = Served([sys.executable, "server.py", "--config", str(write_config(tmp_path))])
    try:
        with KVStoreClient(again.address) as client:
            got = client.get([r.key for r in records])
            assert [bytes(g) for g in got] == [r.payload for r in records]
    finally:
        assert again.stop()[0] == 0


def test_bad_config_is_one_line_and_a_nonzero_exit(tmp_path):
    bad = cli("serve", "--config", str(write_config(tmp_path)), "--dram.capacity-bytes", "lots")
    assert bad.returncode == 2
    assert "dram.capacity_bytes" in bad.stderr and "Traceback" not in bad.stderr
    unknown = cli("serve", "--config", str(write_config(tmp_path, colour="blue")))
    assert unknown.returncode == 2 and "colour" in unknown.stderr
    missing = cli("serve", "--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr


def test_environment_overrides_the_file(tmp_path):
    env = {"KVSTORE_DRAM_CAPACITY_BYTES": "8MiB"}
    out = cli("serve", "--config", str(write_config(tmp_path)), "--print-config", env=env)
    assert out.returncode == 0, out.stderr
    assert re.search(r"capacity_bytes: 8388608", out.stdout)


def test_client_commands_against_no_server_fail_readably():
    out = cli("stats", "--address", "127.0.0.1:1", "--timeout", "1")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "cannot reach the store at 127.0.0.1:1" in out.stderr
    bad = cli("explain", "not-hex", "--address", "127.0.0.1:1")
    assert bad.returncode != 0 and "not hex" in bad.stderr


def test_keys_command_prints_the_published_test_vectors():
    ns = (
        '{"model":"tiny","revision":"r1","num_layers":2,"num_kv_heads":2,"head_dim":64,'
        '"chunk_tokens":32,"codec":"raw","salt":"tenant-a"}'
    )
    out = cli(
        "keys", "--namespace-json", ns, "--tokens", ",".join(["7"] * 64 + ["4294967295"] * 32)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == [
        "namespace d12bfd528d10bdc9459c586445c20fcdc1bc37fd1fa0e4c05772627d53afdd63",
        "chunk 0 788e06caa805aa220b9a025ff279f7c0",
        "chunk 1 07a503f861ca7e5c206bed07d5c185be",
        "chunk 2 9a04c05fe63109f982509855a950555e",
    ]
    bad = cli("keys", "--namespace-json", '{"model":"m"}', "--tokens", "1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
