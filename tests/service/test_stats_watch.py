"""`kvstore stats --watch` as a real subprocess against a real server: the rates it prints
between two refreshes are the traffic this test sent between them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from kvstore.client import KVStoreClient
from tests.chunks import chain, keys_of
from tests.procs import KVSTORE


def watch(address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [KVSTORE, "stats", "--address", address, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def send_traffic(address: str, records) -> None:
    """4 chunks put (into dram, written through to nvme), 2 lookups of 4 keys, 1 get."""
    with KVStoreClient(address) as client:
        assert client.put(records).stored == 4
        for _ in range(2):
            assert client.lookup(keys_of(records)).matched == 4
        assert len(client.get(keys_of(records))) == 4


def read_until(proc: subprocess.Popen, pattern: str) -> str:
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"the watcher stopped: {''.join(lines)!r} {proc.stderr.read()!r}"
        lines.append(line)
        if re.search(pattern, line):
            return "".join(lines)


def test_json_rates_between_refreshes_are_the_traffic_sent(served):
    records = chain(4)
    nbytes = sum(len(r.payload) for r in records)
    proc = watch(served.address, "--watch", "1", "--count", "3", "--json")
    first = json.loads(proc.stdout.readline())
    assert first["rates"] is None  # no interval yet
    send_traffic(served.address, records)
    later = [json.loads(proc.stdout.readline()) for _ in range(2)]
    assert proc.wait(timeout=30) == 0, proc.stderr.read()

    # the traffic may straddle a refresh: the two intervals after it hold all of it
    def sent(field, tier=None):
        return sum(
            (r["rates"]["tiers"][tier] if tier else r["rates"])[field] * r["rates"]["interval_s"]
            for r in later
        )

    for r in later:
        assert 0.9 < r["rates"]["interval_s"] < 5
    assert sent("put_chunks") == pytest.approx(4)
    assert sent("lookups") == pytest.approx(2)
    assert sent("lookup_keys") == pytest.approx(8)
    assert sent("lookup_hit_keys") == pytest.approx(8)
    assert sent("hits") == pytest.approx(4)
    assert sent("bytes_out") == pytest.approx(nbytes)
    assert sent("bytes_in", "dram") == pytest.approx(nbytes)
    assert sent("bytes_in", "nvme") == pytest.approx(nbytes)  # written through
    assert sent("bytes_in") == pytest.approx(2 * nbytes)
    assert later[-1]["stats"]["put_chunks"] == "4"


def test_the_human_view_refreshes_with_rates_per_second(served):
    records = chain(4, seed=3)
    proc = watch(served.address, "--watch", "1", "--count", "3")
    first = read_until(proc, r"^rates: from the next refresh")
    assert first.startswith(f"kvstore 0.1.0 at {served.address}")
    assert "\x1b[" not in first  # not a terminal: blocks one after another, no redraw
    send_traffic(served.address, records)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert rest.count("kvstore 0.1.0 at") == 2
    blocks = re.findall(
        r"over the last ([\d.]+) s\n.*?puts/s +([\d.]+) chunks stored.*?", rest, re.S
    )
    assert len(blocks) == 2
    puts = sum(float(rate) * float(seconds) for seconds, rate in blocks)
    assert puts == pytest.approx(4, abs=0.2)  # rates are printed to 0.1/s
    assert re.search(r"^dram +\d+\.\d +\S+ \S+ +\S+ \S+ +\d+\.\d$", rest, re.M)
    lookups = re.findall(r"lookups/s +([\d.]+) \(([\d.]+) keys/s, hit rate ([\d.]+)%\)", rest)
    assert len(lookups) == 2 and any(float(hit) == 100.0 for _, _, hit in lookups)


def test_ctrl_c_ends_the_watch_cleanly(served):
    proc = watch(served.address, "--watch", "0.2")
    read_until(proc, r"^rates: from the next refresh")
    read_until(proc, r"^rates per second")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert err == "", err


def test_a_reader_that_goes_away_ends_the_watch_quietly(served):
    # `kvstore stats --watch | head -3`: head closes the pipe after its lines
    for args in (["--watch", "0.1"], ["--watch", "0.1", "--json"]):
        proc = watch(served.address, *args)
        assert proc.stdout.readline()
        proc.stdout.close()  # the next refresh writes into a closed pipe
        assert proc.wait(timeout=30) == 0, args
        err = proc.stderr.read()
        assert err == "", (args, err)


def test_bad_watch_arguments_are_one_line_errors(served):
    for args in (["--watch", "0"], ["--watch", "soon"], ["--count", "2"]):
        proc = watch(served.address, *args)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and "Traceback" not in err, (args, err)
        assert err.strip().count("\n") <= 1 or "usage:" in err
