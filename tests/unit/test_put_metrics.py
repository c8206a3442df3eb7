"""The put process's metrics relay (``kvstore.server.put_metrics``) into a real store's
``Metrics``: counted as the store's own, pooled bytes from the newest report of the
running put process only, nothing held once it exits, and a report that cannot be sent never fails
the call it reports on. The channel itself is exercised with the real child process in
``tests/service/test_put_process.py``; here the relay hands its batches straight over."""

from __future__ import annotations

import pytest

from kvstore.server.metrics import Metrics
from kvstore.server.put_metrics import MetricsRelay, Relayed
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from tests.chunks import CHUNK_COST


@pytest.fixture
def store():
    s = TieredStore([DramTier(8 * CHUNK_COST)])
    yield s
    s.close()


def scraped(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_call_and_what_it_gathered_arrive_as_the_store_s_own(store):
    metrics = Metrics(store.stats)
    relayed = Relayed(metrics, store)
    relayed.started(1)
    relay = MetricsRelay(lambda batch: relayed.apply(batch, 1))
    relay.watch_puts(lambda: 5.0, lambda: 7.0)
    metrics.watch_puts(lambda: 100.0, lambda: 1000.0)  # the store's own service
    relay.bytes_transferred("in", 300)
    relay.rejected("too_many_bytes")
    relay.chunk_refused("bad_payload")
    relay.chunk_refused("parent_rejected")
    relay.chunk_refused("parent_rejected")
    assert scraped(metrics, "kvstore_wire_bytes_total", direction="in") == 0  # not yet sent
    relay.observe_rpc("Put", 0.25, "RESOURCE_EXHAUSTED")
    assert scraped(metrics, "kvstore_rpc_total", method="Put", code="RESOURCE_EXHAUSTED") == 1
    assert scraped(metrics, "kvstore_rpc_duration_seconds_sum", method="Put") == 0.25
    assert scraped(metrics, "kvstore_put_process_calls_total", code="RESOURCE_EXHAUSTED") == 1
    assert scraped(metrics, "kvstore_wire_bytes_total", direction="in") == 300
    assert scraped(metrics, "kvstore_rejected_requests_total", reason="too_many_bytes") == 1
    assert store.stats().rejected == {"bad_payload": 1, "parent_rejected": 2}
    assert scraped(metrics, "kvstore_store_rejected_total", reason="parent_rejected") == 2
    assert scraped(metrics, "kvstore_put_buffers_pooled_bytes") == 1007
    assert scraped(metrics, "kvstore_put_inflight_bytes") == 100  # the store's own only
    relay.observe_rpc("Put", 0.5, "OK")  # nothing else gathered: counted once, not again
    assert scraped(metrics, "kvstore_wire_bytes_total", direction="in") == 300
    assert scraped(metrics, "kvstore_rpc_total", method="Put", code="OK") == 1


def test_pooled_bytes_come_from_the_newest_report_of_the_running_put_process_only(store):
    metrics = Metrics(store.stats)
    relayed = Relayed(metrics, store)
    sent: list[dict] = []
    relay = MetricsRelay(sent.append)
    held = {"pooled": 0.0}
    relay.watch_puts(lambda: 0.0, lambda: held["pooled"])
    for pooled in (10.0, 20.0, 30.0):
        held["pooled"] = pooled
        relay.observe_rpc("Put", 0.1, "OK")
    older, newer, last = sent
    relayed.started(1)
    relayed.apply(newer, 1)
    relayed.apply(older, 1)  # two calls that ended together, reported out of order
    assert scraped(metrics, "kvstore_put_buffers_pooled_bytes") == 20
    assert scraped(metrics, "kvstore_put_process_calls_total", code="OK") == 2
    relayed.ended()  # the put process exited: what it held went with it
    assert scraped(metrics, "kvstore_put_buffers_pooled_bytes") == 0
    relayed.started(2)
    relayed.apply(last, 1)  # a report the dead one sent before it went, answered late
    assert scraped(metrics, "kvstore_put_buffers_pooled_bytes") == 0
    assert scraped(metrics, "kvstore_put_process_calls_total", code="OK") == 3  # still counted
    fresh = MetricsRelay(lambda batch: relayed.apply(batch, 2))
    fresh.watch_puts(lambda: 0.0, lambda: 4.0)
    fresh.observe_rpc("Put", 0.1, "OK")  # its seq 1, below the dead one's: still taken
    assert scraped(metrics, "kvstore_put_buffers_pooled_bytes") == 4


def test_a_report_the_store_cannot_take_does_not_fail_the_call(store, caplog):
    def refuse(batch: dict) -> None:
        raise ConnectionRefusedError("the store is gone")

    relay = MetricsRelay(refuse)
    relay.observe_rpc("Put", 0.1, "OK")  # returns: the call it reports on is answered
    assert "could not report" in caplog.text
