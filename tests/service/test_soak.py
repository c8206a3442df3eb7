"""A short soak (the quick form of ``benchmarks/soak.py``, whose full form is 32 clients
for 60 s): concurrent clients mixing Lookup, Get, shm Get, Put and Delete over chunks
of 4 KiB to 4 MiB against a real store that evicts all the time. No error, no wrong
byte, and the server's memory stays within its configured capacities."""

from __future__ import annotations

from benchmarks.soak import run


def test_a_short_soak_has_no_errors_no_wrong_bytes_and_bounded_memory(tmp_path):
    result = run(clients=8, seconds=6.0, workdir=tmp_path)
    assert result["unexpected_errors"] == 0, result["first_errors"]
    assert result["wrong_bytes_chunks"] == 0
    assert result["chunks_verified"] > 100
    assert result["evictions"] > 0  # the small DRAM tier really was under pressure
    assert set(result["rpcs"]) >= {"Put", "Get", "GetShm", "Lookup", "Delete"}
    assert result["rss_vs_capacities"] <= 1.2
