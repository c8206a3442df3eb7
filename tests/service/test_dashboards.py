"""The Grafana dashboard and the Prometheus alert rules under deploy/ ask only for metrics
a real store exports: every PromQL expression is taken apart and each metric it names is
looked up in a scrape of a real server's /metrics after known traffic."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import ClientError, KVStoreClient
from kvstore.server.metrics import Metrics
from tests.chunks import chain, keys_of

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvstore.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
# Series Prometheus makes itself for every target, whatever the target exports.
SYNTHETIC = {"up"}

_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
    "group_left",
    "group_right",
}
_TOKEN = re.compile(
    r"(?P<num>0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)"
)


def _strip(expr: str) -> str:
    """PromQL with strings, template variables, label matchers, ranges and grouping
    label lists removed: what is left names metrics, functions and operators."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables ($instance, ${__range})
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery selectors
    expr = re.sub(r"\boffset\s+-?\w+", "", expr)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression selects (function and aggregation names, keywords,
    numbers and label names are not metrics)."""
    text = _strip(expr)
    names = set()
    for m in _TOKEN.finditer(text):
        name = m.group("id")
        if name is None or name in _KEYWORDS or text[m.end() :].lstrip().startswith("("):
            continue
        names.add(name)
    return names


def rated(expr: str) -> set[str]:
    """Metrics passed straight to rate(), irate() or increase(): they must be counters."""
    return set(re.findall(r"\b(?:rate|irate|increase)\s*\(\s*([a-zA-Z_:][\w:]*)", _strip(expr)))


def test_the_tokenizer_finds_metrics_and_nothing_else():
    expr = (
        "histogram_quantile(0.99, sum by (le, method) (rate(kvstore_rpc_duration_seconds_bucket"
        '{instance=~"$instance",method="Get"}[$__rate_interval]))) > 1e-3 and on (instance) '
        'up{job="kvstore"} == 0 or sum without (tier) (kvstore_tier_used_bytes) / '
        "ignoring (tier) group_left max(kvstore_tier_capacity_bytes offset 5m)"
    )
    assert metric_names(expr) == {
        "kvstore_rpc_duration_seconds_bucket",
        "up",
        "kvstore_tier_used_bytes",
        "kvstore_tier_capacity_bytes",
    }
    assert rated(expr) == {"kvstore_rpc_duration_seconds_bucket"}
    assert metric_names("label_values(kvstore_chunks, instance)") == {"kvstore_chunks", "instance"}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    exprs = [t["expr"] for p in panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            # label_values(metric, label): the second argument is a label, not a metric
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


@pytest.fixture
def exported(serve, open_store) -> dict[str, str]:
    """Sample name -> metric type, scraped over HTTP from a real server after traffic that
    fills dram (evictions, demotions), reads back from nvme (promotions), uses shared
    memory and leases, and gets refusals."""
    store = open_store(dram_slots=4, nvme_bytes=64 << 20)
    metrics = Metrics(store.stats)
    served = serve(store, metrics=metrics)
    endpoint = metrics.serve_http("127.0.0.1:0")
    try:
        records = chain(8)
        with KVStoreClient(served.address) as client:
            assert client.put(records).stored == 8
            assert client.lookup(keys_of(records), lease_ttl_s=5).matched == 8
            assert len(client.get(keys_of(records))) == 8
            assert len(client.get(keys_of(records[:2]), shm=True)) == 2
            client.put([chain(2, seed=1)[1]])  # an orphan: the store refuses it
            with pytest.raises(ClientError):
                client.release(987654)  # NOT_FOUND
            client.stats()
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        endpoint.close()
    types = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            types[s.name] = family.type
    stats = store.stats()
    assert stats.tiers[0].evictions > 0 and stats.tiers[1].hits > 0  # the traffic did its job
    return types


def check(exprs: list[str], exported: dict[str, str]) -> None:
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported.keys() - SYNTHETIC
        assert not unknown, f"{expr!r} names metrics the store does not export: {unknown}"
        for name in rated(expr):
            kind = exported.get(name)
            counter = kind == "counter" and name.endswith("_total")
            histogram = kind == "histogram" and name.endswith(("_bucket", "_sum", "_count"))
            assert counter or histogram, f"{expr!r} takes the rate of {name}, a {kind}"


def test_the_check_refuses_unknown_metrics_and_rates_of_gauges():
    exported = {"kvstore_chunks": "gauge", "kvstore_lookups_total": "counter"}
    check(["sum(rate(kvstore_lookups_total[5m])) / kvstore_chunks"], exported)
    with pytest.raises(AssertionError, match="does not export"):
        check(["kvstore_lookups_total + kvstore_lookup_misses_total"], exported)
    with pytest.raises(AssertionError, match="rate of kvstore_chunks, a gauge"):
        check(["rate(kvstore_chunks[5m])"], exported)


def test_every_dashboard_query_names_exported_metrics(exported):
    # the connector's panels (vllm:kvstore_*) are checked against a real vLLM's /metrics
    # in tests/connector/test_connector_metrics.py
    check([e for e in dashboard_exprs() if "vllm:" not in e], exported)


def test_every_alert_names_exported_metrics(exported):
    check([rule["expr"] for rule in alert_rules()], exported)


def test_the_dashboard_covers_what_an_operator_asks_and_is_provisionable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvstore" and dash["title"]
    exprs = " ".join(dashboard_exprs())
    for metric in (
        "kvstore_tier_hits_total",  # hit rate per tier
        "kvstore_lookup_hit_keys_total",
        "kvstore_wire_bytes_total",  # bytes in/out
        "kvstore_tier_bytes_in_total",
        "kvstore_tier_occupancy_ratio",  # occupancy
        "kvstore_tier_evictions_total",  # evictions
        "kvstore_rpc_duration_seconds_bucket",  # latency
        "kvstore_rpc_total",  # errors by code
    ):
        assert metric in exprs, metric
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["title"] and p["description"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kvstore.yaml").read_text())
    assert provider["providers"][0]["type"] == "file"
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert source["datasources"][0]["type"] == "prometheus"


def test_every_alert_says_how_bad_and_what_happened():
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_the_scrape_config():
    for args in (
        ["check", "rules", str(ALERTS)],
        ["check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
    ):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
