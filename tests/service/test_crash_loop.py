"""kill -9 a real `kvstore serve` during heavy Put traffic, three times per write policy
(the quick form of ``benchmarks/crash_loop.py``; its full form kills 20 times): under
write_through nothing acknowledged is ever lost, under write_back only what DRAM alone
held; nothing comes back wrong and the stats agree with what is served."""

from __future__ import annotations

from benchmarks.crash_loop import run


def test_write_through_loses_nothing_acknowledged_across_kills(tmp_path):
    result = run("write_through", restarts=3, traffic_s=0.6, workdir=tmp_path)
    assert result["acked_chunks"] > 0
    assert result["lost_chunks"] == 0
    assert result["corrupt_counted"] == 0
    assert result["rounds"][-1]["kept"] == result["acked_chunks"]  # all still within KEEP_CHAINS


def test_write_back_loses_at_most_what_only_dram_held(tmp_path):
    # run() raises if any chunk comes back with other bytes than were put
    result = run("write_back", restarts=3, traffic_s=0.6, workdir=tmp_path)
    assert result["corrupt_counted"] == 0
    assert any(r["kept"] for r in result["rounds"][1:])  # demoted before the kill: kept
