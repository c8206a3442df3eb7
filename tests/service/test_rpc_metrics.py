"""The service's metrics on a real server: a streamed Get is timed to its end, refusals are
counted under fixed codes, and /metrics passes Prometheus' own lint (promtool's rules)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import ClientError, KVStoreClient
from kvstore.core import codec
from kvstore.core.keys import Namespace, chunk_keys
from kvstore.core.types import ChunkRecord
from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.metrics import REJECT_REASONS, STORE_REJECT_REASONS, Metrics
from tests.chunks import chain, keys_of

MiB = 1 << 20
# 2 MiB chunks: a stream of a dozen cannot hide in gRPC's flow-control windows
BIG = Namespace(
    "metrics-test", "r0", num_layers=8, num_kv_heads=8, head_dim=64, chunk_tokens=128, codec="raw"
)


def big_chain(n: int) -> list[ChunkRecord]:
    keys = chunk_keys(BIG.digest(), list(range(n * BIG.chunk_tokens)), BIG.chunk_tokens)
    shape = (BIG.num_layers, BIG.num_kv_heads, BIG.chunk_tokens, BIG.head_dim)
    out = []
    for i, key in enumerate(keys):
        k = torch.full(shape, float(i), dtype=torch.float16)
        payload = bytes(codec.encode(k, k, "raw"))
        out.append(ChunkRecord(key, keys[i - 1] if i else None, BIG.digest(), payload))
    return out


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def get_calls(metrics: Metrics, code: str = "OK") -> tuple[float, float]:
    got = samples(metrics)
    count = got.get(("kvstore_rpc_total", frozenset({"method": "Get", "code": code}.items())), 0)
    total = got.get(("kvstore_rpc_duration_seconds_sum", frozenset({"method": "Get"}.items())), 0)
    return count, total


@pytest.fixture
def metered(serve, open_store):
    store = open_store(dram_slots=1024, nvme_bytes=256 * MiB)
    metrics = Metrics(store.stats)
    served = serve(store, metrics=metrics)
    channel = grpc.insecure_channel(
        served.address,
        options=[("grpc.max_receive_message_length", 64 * MiB)],
    )
    get = channel.unary_stream(f"/{SERVICE}/Get", pb.GetRequest.SerializeToString, None)
    yield served, metrics, get
    channel.close()


def test_a_streamed_get_is_timed_until_its_last_chunk_is_sent(metered):
    served, metrics, get = metered
    records = big_chain(12)
    with KVStoreClient(served.address) as c:
        assert c.put(records, timeout_s=60).stored == 12
    t0 = time.perf_counter()
    n = 0
    for _ in get(pb.GetRequest(keys=keys_of(records)), timeout=60):
        n += 1
        time.sleep(0.1)  # a slow reader: the server can only send as fast as it reads
    reader_s = time.perf_counter() - t0
    assert n == 12
    count, seconds = get_calls(metrics)
    assert count == 1
    # the reader spent 1.2 s; only some chunks fit in the transport's buffers (how many
    # depends on gRPC's flow-control windows), so the server's own call lasted a good part
    # of that (it was recorded in ~1 ms before the fix)
    assert 0.25 * reader_s < seconds <= reader_s + 0.05, (seconds, reader_s)
    out = samples(metrics)[("kvstore_wire_bytes_total", frozenset({"direction": "out"}.items()))]
    assert out >= sum(len(r.payload) for r in records)


def test_a_get_the_client_abandons_is_recorded_as_cancelled(metered):
    served, metrics, get = metered
    records = big_chain(12)
    with KVStoreClient(served.address) as c:
        assert c.put(records, timeout_s=60).stored == 12
    stream = get(pb.GetRequest(keys=keys_of(records)), timeout=60)
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while get_calls(metrics, "CANCELLED")[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get_calls(metrics, "CANCELLED")[0] == 1
    assert get_calls(metrics, "OK")[0] == 0


def test_refusals_are_counted_under_fixed_codes_only(metered):
    served, metrics, _ = metered
    with KVStoreClient(served.address) as c:
        orphan = chain(2, seed=9)[1]  # its parent was never stored: the store refuses it
        assert [why for _, why in c.put([orphan]).rejected] == ["parent is not stored"]
        with pytest.raises(ClientError):
            c.lookup([b"short"])
    got = samples(metrics)
    service = {
        dict(labels)["reason"]: v
        for (name, labels), v in got.items()
        if name == "kvstore_rejected_requests_total"
    }
    store = {
        dict(labels)["reason"]: v
        for (name, labels), v in got.items()
        if name == "kvstore_store_rejected_total"
    }
    # every code is exported from the start; a chunk the store refused is the store's count
    assert set(service) == set(REJECT_REASONS) and set(store) == set(STORE_REJECT_REASONS)
    assert {r: v for r, v in service.items() if v} == {"invalid_argument": 1}
    assert {r: v for r, v in store.items() if v} == {"parent_not_stored": 1}


def scrape_after_traffic(served, metrics: Metrics) -> str:
    records = chain(3)
    with KVStoreClient(served.address) as c:
        c.put(records)
        c.lookup(keys_of(records), lease_ttl_s=5)
        c.get(keys_of(records))
        c.get(keys_of(records), shm=True)
        c.put([chain(2, seed=4)[1]])
        with pytest.raises(ClientError):
            c.release(123456)
        c.stats()
    return metrics.render().decode()


# promtool's lint (prometheus/client_golang/prometheus/testutil/promlint), in Python
_NON_BASE_UNITS = (
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "kibibytes",
    "mebibytes",
    "bits",
    "percent",
    "celsius",
)


def lint(text: str) -> list[str]:
    problems = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            problems.append(f"{name}: not snake_case")
        if not family.documentation.strip():
            problems.append(f"{name}: no help text")
        for unit in _NON_BASE_UNITS:
            if re.search(rf"(^|_){unit}(_|$)", name):
                problems.append(f"{name}: use base units, not {unit}")
        names = {s.name for s in family.samples}
        if family.type == "counter":
            if not all(n.endswith("_total") or n.endswith("_created") for n in names):
                problems.append(f"{name}: a counter's samples must end in _total")
        elif any(n.endswith("_total") for n in names):
            problems.append(f"{name}: only counters end in _total")
        if family.type == "histogram" and not name.endswith(("_seconds", "_bytes")):
            problems.append(f"{name}: a histogram names its unit")
        for s in family.samples:
            for label in s.labels:
                if not re.fullmatch(r"[a-z_][a-z0-9_]*", label):
                    problems.append(f"{name}: label {label} is not snake_case")
    return problems


def test_metrics_follow_prometheus_conventions_with_bounded_labels(metered):
    served, metrics, _ = metered
    text = scrape_after_traffic(served, metrics)
    assert lint(text) == []
    codes = {c.name for c in grpc.StatusCode}
    methods = {"Lookup", "Get", "GetShm", "Put", "Release", "Delete", "Stats", "Explain"}
    methods.add("Routes")  # a client's first put asks where puts go
    tiers = {t.name for t in served.store.tiers}
    allowed = {
        "reason": set(REJECT_REASONS) | set(STORE_REJECT_REASONS),
        "code": codes,
        "method": methods,
        "tier": tiers,
        "direction": {"in", "out"},
        "le": None,  # histogram buckets: fixed by RPC_BUCKETS
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for label, value in s.labels.items():
                assert label in allowed, f"{s.name} has an unexpected label {label}"
                if allowed[label] is not None:
                    assert value in allowed[label], f"{s.name}{{{label}={value!r}}}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_passes(metered):
    served, metrics, _ = metered
    text = scrape_after_traffic(served, metrics)
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr
