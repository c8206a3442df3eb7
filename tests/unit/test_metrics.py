"""Metrics over a real TieredStore, scraped from the real /metrics HTTP endpoint."""

import ast
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from kvstore.server.metrics import REJECT_REASONS, STORE_REJECT_REASONS, Metrics
from kvstore.server.stats import StoreStats, TierStats
from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier
from tests.chunks import CHUNK_COST, chain

SLOT = CHUNK_COST
DRAM_SLOTS = 64
MiB = 1 << 20

EXPORTED = {
    "kvstore_rpc_duration_seconds": "histogram",
    "kvstore_rpc_total": "counter",
    "kvstore_rejected_requests_total": "counter",
    "kvstore_wire_bytes_total": "counter",
    "kvstore_put_inflight_bytes": "gauge",
    "kvstore_put_buffers_pooled_bytes": "gauge",
    "kvstore_put_process_up": "gauge",
    "kvstore_put_process_restarts": "gauge",
    "kvstore_put_process_calls_total": "counter",
    "kvstore_tier_capacity_bytes": "gauge",
    "kvstore_tier_used_bytes": "gauge",
    "kvstore_tier_chunks": "gauge",
    "kvstore_tier_occupancy_ratio": "gauge",
    "kvstore_tier_hits_total": "counter",
    "kvstore_tier_bytes_in_total": "counter",
    "kvstore_tier_bytes_out_total": "counter",
    "kvstore_tier_evictions_total": "counter",
    "kvstore_tier_demotions_total": "counter",
    "kvstore_tier_promotions_total": "counter",
    "kvstore_tier_corrupt_total": "counter",
    "kvstore_chunks": "gauge",
    "kvstore_lookups_total": "counter",
    "kvstore_lookup_keys_total": "counter",
    "kvstore_lookup_hit_keys_total": "counter",
    "kvstore_misses_total": "counter",
    "kvstore_put_batches_total": "counter",
    "kvstore_put_chunks_total": "counter",
    "kvstore_put_duplicates_total": "counter",
    "kvstore_store_rejected_total": "counter",
    "kvstore_active_leases": "gauge",
    "kvstore_expired_leases_total": "counter",
    "kvstore_namespaces": "gauge",
}


@pytest.fixture
def store(tmp_path):
    tiers = [DramTier(DRAM_SLOTS * SLOT), NvmeTier(str(tmp_path / "lmdb"), 64 * MiB)]
    s = TieredStore(tiers, write_policy="write_through")
    yield s
    s.close()


@pytest.fixture
def serve():
    endpoints = []

    def _serve(metrics: Metrics):
        endpoint = metrics.serve_http("127.0.0.1:0")
        endpoints.append(endpoint)
        return endpoint

    yield _serve
    for endpoint in endpoints:
        endpoint.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: dict, name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]


def test_a_scrape_reports_the_traffic_exactly(store, serve):
    records = chain(4)
    keys = [r.key for r in records]
    chunk_bytes = sum(len(r.payload) for r in records)
    assert store.put(records).stored == 4
    orphan = chain(2, seed=7)[1]  # its parent was never stored
    assert len(store.put([orphan]).rejected) == 1
    assert store.lookup(keys + [b"\x00" * 16], lease_ttl_s=60).matched == 4
    assert len(store.get(keys + [b"\x00" * 16])) == 4

    metrics = Metrics(store.stats)
    metrics.observe_rpc("Lookup", 0.0002, "OK")
    metrics.observe_rpc("Lookup", 0.0002, "OK")
    metrics.observe_rpc("Get", 0.003, "OK")
    metrics.observe_rpc("Put", 0.5, "RESOURCE_EXHAUSTED")
    metrics.rejected("too_large")
    metrics.rejected("tiers_full", 3)
    metrics.bytes_transferred("in", chunk_bytes)
    metrics.bytes_transferred("out", chunk_bytes)
    metrics.bytes_transferred("out", 10)
    got = samples(scrape(serve(metrics).port))

    assert value(got, "kvstore_rpc_total", method="Lookup", code="OK") == 2
    assert value(got, "kvstore_rpc_total", method="Put", code="RESOURCE_EXHAUSTED") == 1
    lookup = {"method": "Lookup"}
    assert value(got, "kvstore_rpc_duration_seconds_count", **lookup) == 2
    assert value(got, "kvstore_rpc_duration_seconds_sum", **lookup) == pytest.approx(0.0004)
    assert value(got, "kvstore_rpc_duration_seconds_bucket", le="0.0001", **lookup) == 0
    assert value(got, "kvstore_rpc_duration_seconds_bucket", le="0.00025", **lookup) == 2
    assert value(got, "kvstore_rpc_duration_seconds_bucket", le="+Inf", **lookup) == 2
    assert value(got, "kvstore_rejected_requests_total", reason="too_large") == 1
    assert value(got, "kvstore_rejected_requests_total", reason="tiers_full") == 3
    assert value(got, "kvstore_wire_bytes_total", direction="in") == chunk_bytes
    assert value(got, "kvstore_wire_bytes_total", direction="out") == chunk_bytes + 10

    dram, nvme = {"tier": "dram"}, {"tier": "nvme"}
    assert value(got, "kvstore_tier_chunks", **dram) == 4
    assert value(got, "kvstore_tier_chunks", **nvme) == 4  # written through
    assert value(got, "kvstore_tier_capacity_bytes", **dram) == DRAM_SLOTS * SLOT
    assert value(got, "kvstore_tier_used_bytes", **dram) == 4 * SLOT  # key + payload, rounded
    assert value(got, "kvstore_tier_occupancy_ratio", **dram) == pytest.approx(4 / DRAM_SLOTS)
    nvme_used = value(got, "kvstore_tier_used_bytes", **nvme)
    nvme_capacity = value(got, "kvstore_tier_capacity_bytes", **nvme)
    assert value(got, "kvstore_tier_occupancy_ratio", **nvme) == pytest.approx(
        nvme_used / nvme_capacity
    )
    assert value(got, "kvstore_tier_hits_total", **dram) == 4
    assert value(got, "kvstore_tier_hits_total", **nvme) == 0
    assert value(got, "kvstore_tier_bytes_in_total", **dram) == chunk_bytes
    assert value(got, "kvstore_tier_bytes_in_total", **nvme) == chunk_bytes
    assert value(got, "kvstore_tier_bytes_out_total", **dram) == chunk_bytes
    for name in ("evictions", "demotions", "promotions", "corrupt"):
        assert value(got, f"kvstore_tier_{name}_total", **dram) == 0

    assert value(got, "kvstore_chunks") == 4
    assert value(got, "kvstore_lookups_total") == 1
    assert value(got, "kvstore_lookup_keys_total") == 5
    assert value(got, "kvstore_lookup_hit_keys_total") == 4
    assert value(got, "kvstore_misses_total") == 1
    assert value(got, "kvstore_put_batches_total") == 2
    assert value(got, "kvstore_put_chunks_total") == 4
    assert value(got, "kvstore_put_duplicates_total") == 0
    assert value(got, "kvstore_store_rejected_total", reason="parent_not_stored") == 1
    assert value(got, "kvstore_active_leases") == 1
    assert value(got, "kvstore_expired_leases_total") == 0
    assert value(got, "kvstore_namespaces") == 1


def test_stats_are_read_at_each_scrape_not_copied_at_start(store, serve):
    metrics = Metrics(store.stats)
    endpoint = serve(metrics)
    assert value(samples(scrape(endpoint.port)), "kvstore_chunks") == 0
    store.put(chain(3))
    assert value(samples(scrape(endpoint.port)), "kvstore_chunks") == 3


def test_names_follow_prometheus_conventions(store, serve):
    metrics = Metrics(store.stats)
    metrics.observe_rpc("Get", 0.01, "OK")
    metrics.rejected("bad_payload")
    metrics.bytes_transferred("in", 1)
    store.put([chain(2, seed=3)[1]])  # one store rejection, so that family has a sample
    text = scrape(serve(metrics).port)
    assert "_total_total" not in text
    types = {}
    helps = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP "):
            name, help_text = line[len("# HELP ") :].split(" ", 1)
            helps[name] = help_text
    # A Counter also exports its creation time as a ``<name>_created`` gauge.
    created = {n for n, kind in types.items() if n.endswith("_created") and kind == "gauge"}
    assert {n: k for n, k in types.items() if n not in created} == EXPORTED
    assert all(helps[name].strip() for name in types)
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvstore_")
        if family.type == "counter":
            for s in family.samples:
                assert s.name.endswith("_total") and s.name.count("_total") == 1, s.name


def test_two_instances_coexist_in_one_process(serve):
    def fixed(chunks: int):
        return lambda: StoreStats(tiers=[TierStats("dram", 100, 10, chunks)], chunks=chunks)

    a, b = Metrics(fixed(1)), Metrics(fixed(2))
    a.observe_rpc("Get", 0.001, "OK")
    ea, eb = serve(a), serve(b)
    assert ea.port != eb.port
    got_a, got_b = samples(scrape(ea.port)), samples(scrape(eb.port))
    assert value(got_a, "kvstore_chunks") == 1 and value(got_b, "kvstore_chunks") == 2
    assert value(got_a, "kvstore_rpc_total", method="Get", code="OK") == 1
    assert ("kvstore_rpc_total", frozenset({"method": "Get", "code": "OK"}.items())) not in got_b
    assert value(got_a, "kvstore_tier_occupancy_ratio", tier="dram") == pytest.approx(0.1)
    assert a.render() != b.render()


def test_a_closed_endpoint_stops_serving():
    endpoint = Metrics(lambda: StoreStats(tiers=[])).serve_http("127.0.0.1:0")
    scrape(endpoint.port)
    endpoint.close()
    with pytest.raises(OSError):
        scrape(endpoint.port)


def test_bad_arguments_are_refused():
    metrics = Metrics(lambda: StoreStats(tiers=[]))
    with pytest.raises(ValueError, match="direction"):
        metrics.bytes_transferred("sideways", 1)
    for listen in ("9400", "host:", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="host:port"):
            metrics.serve_http(listen)


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _reason_codes(path: Path) -> set[str]:
    """The reason codes a module passes to the metrics: the string argument of each
    ``_Abort``/``QuotaExceeded``/``_reject``/``count_rejected`` call, the codes of
    ``_CODES``, and the first field of the store's ``(code, message)`` rejections."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if fn in ("Abort", "QuotaExceeded") and isinstance(node.args[-1], ast.Constant):
                found.add(node.args[-1].value)
            elif fn in ("_reject", "count_rejected"):
                found |= {c.value for c in ast.walk(node.args[0]) if _is_str(c)}
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_CODES":
            found |= {t.elts[2].value for t in node.value.elts}
        elif (
            isinstance(node, ast.Tuple)
            and len(node.elts) == 2
            and all(isinstance(e, ast.Constant | ast.JoinedStr) for e in node.elts)
            and _is_str(node.elts[0])
            and re.fullmatch(r"[a-z_]+", node.elts[0].value)
        ):
            found.add(node.elts[0].value)
    return found


def test_every_reason_code_in_the_code_is_a_fixed_label_value():
    package = Path(kvstore.__file__).parent / "server"
    service = set().union(
        *(_reason_codes(p) for p in [*package.glob("service*.py"), package / "quotas.py"])
    )
    store = _reason_codes(package / "store.py")
    assert {"too_many_keys", "shutting_down", "too_many_streams"} <= service  # the scan works
    assert {"parent_not_stored", "write_failed"} <= store
    assert service <= set(REJECT_REASONS), service - set(REJECT_REASONS)
    assert store <= set(STORE_REJECT_REASONS), store - set(STORE_REJECT_REASONS)


def test_an_unknown_reason_counts_as_other_so_the_label_set_stays_bounded():
    metrics = Metrics(
        lambda: StoreStats(tiers=[], rejected={"parent_not_stored": 2, "something new": 1})
    )
    metrics.rejected("a free-text message with 17 bytes")
    got = samples(metrics.render().decode())
    assert value(got, "kvstore_rejected_requests_total", reason="other") == 1
    assert value(got, "kvstore_rejected_requests_total", reason="too_large") == 0
    assert value(got, "kvstore_store_rejected_total", reason="other") == 1
    assert value(got, "kvstore_store_rejected_total", reason="parent_not_stored") == 2
    reasons = {
        dict(labels)["reason"]
        for name, labels in got
        if name in ("kvstore_rejected_requests_total", "kvstore_store_rejected_total")
    }
    assert reasons == set(REJECT_REASONS) | set(STORE_REJECT_REASONS)
