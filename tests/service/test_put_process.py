"""The put process: a store started as ``kvstore serve`` starts it serves ``Put`` from a
process of its own, which checks, copies and persists real-model-sized chunks, dies
without leaving anything behind, is restarted, and never outlives its store.

Real parts throughout: ``kvstore.server.app.start`` in this process (so the test can
look at the store's index), the put process as the real child it starts, a real DRAM
region and a real LMDB; the last test runs the store as a ``kvstore serve`` process.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import torch
import yaml

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.core.types import ChunkRecord
from kvstore.rpc.pb import SERVICE, pb
from kvstore.rpc.tls import ClientAuth
from kvstore.server import app
from kvstore.server.config import load_config
from tests.certs import make_pki
from tests.chunks import chain, keys_of, payloads_of
from tests.procs import KVSTORE, Served, store_config
from tests.service.test_real_sizes import FP8_BYTES, llama_chains
from tests.service.test_security import TOKENS

DIRECT = ClientOptions(timeout_s=60.0)  # for the put process's own port: it has no Routes


def _config(lmdb, **over):
    return load_config(
        env={},
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.metrics_listen": "",
            "dram.capacity_bytes": 256 << 20,
            "nvme.path": str(lmdb),
            "nvme.map_size": 1 << 30,
            **over,
        },
    )


def _wait_port(running, old: int | None = None, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        port = running.server.service.put_port
        if port and port != old:
            return port
        time.sleep(0.05)
    raise AssertionError("the put process never reported a port")


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _scraped(running, name: str, **labels) -> float:
    return running.server.service.metrics.registry.get_sample_value(name, labels) or 0.0


def _put_calls(running) -> int:
    """Put calls the store served itself: all it counts, less its put process's."""
    text = running.server.service.metrics.render().decode()
    every = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstore_rpc_duration_seconds_count") and 'method="Put"' in line
    )
    theirs = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstore_put_process_calls_total")
    )
    return round(every - theirs)


def _lmdb_orphans(store) -> list[bytes]:
    """Keys in LMDB that the index does not place there."""
    out = []
    for chunk in store.tiers[-1].scan():
        node = store.index.get(chunk.key)
        if node is None or not node.in_tier(store.last):
            out.append(chunk.key)
    return out


@pytest.fixture
def running(tmp_path):
    started = []

    def start(**over):
        r = app.start(_config(tmp_path / "lmdb", **over))
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def test_real_sized_chunks_put_through_the_put_process_are_stored_persisted_and_identical(
    running, tmp_path
):
    r = running()
    port = _wait_port(r)
    pid = r.put_process.pid
    assert pid != os.getpid() and _alive(pid)
    fp8, _ = llama_chains(2, seed=21)
    tiny = chain(3, seed=22)
    assert len(fp8[0].payload) == FP8_BYTES
    with KVStoreClient(f"127.0.0.1:{port}", DIRECT) as putter:
        assert putter.put(fp8).stored == 2
        assert putter.put(tiny).stored == 3
        assert putter.put(tiny).duplicates == 3
    assert _put_calls(r) == 0  # none of those bytes reached the store's own Put
    store = r.server.store
    assert [t.chunks for t in store.stats().tiers] == [5, 5]
    assert store._tickets == {} and store._claims == {} and _lmdb_orphans(store) == []
    with KVStoreClient(r.address) as client:
        assert [bytes(p) for p in client.get(keys_of(fp8))] == payloads_of(fp8)
        dests = [torch.empty(len(x.payload), dtype=torch.uint8) for x in tiny]
        assert client.get_shm_into(keys_of(tiny), dests) == 3
        assert [d.numpy().tobytes() for d in dests] == payloads_of(tiny)
    r.stop()
    assert not _alive(pid)  # it stops with its store
    # what the put process wrote to LMDB, read back by a store with no DRAM at all
    again = running(**{"dram.enabled": False, "server.put_process": False})
    assert again.put_process is None
    with KVStoreClient(again.address) as client:
        assert [bytes(p) for p in client.get(keys_of(fp8))] == payloads_of(fp8)
        assert [bytes(p) for p in client.get(keys_of(tiny))] == payloads_of(tiny)


def test_the_put_process_refuses_a_bad_payload_and_stores_nothing_of_it_or_after_it(running):
    r = running()
    port = _wait_port(r)
    records = chain(3, seed=23)
    spoiled = bytearray(records[1].payload)
    spoiled[-1] ^= 0xFF  # one flipped bit in the body: the checksum catches it
    records[1] = ChunkRecord(records[1].key, records[1].parent, records[1].ns, bytes(spoiled))
    with KVStoreClient(f"127.0.0.1:{port}", DIRECT) as putter:
        result = putter.put(records)
    assert result.stored == 1
    assert [k for k, _ in result.rejected] == keys_of(records)[1:]
    assert "checksum" in result.rejected[0][1]
    store = r.server.store
    assert store.lookup(keys_of(records)).matched == 1
    assert [t.chunks for t in store.stats().tiers] == [1, 1] and _lmdb_orphans(store) == []


def test_the_put_process_s_calls_refusals_and_bytes_are_on_the_store_s_metrics(running):
    r = running()
    port = _wait_port(r)
    fp8, _ = llama_chains(1, seed=25)
    good, spoiled = chain(2, seed=26), chain(3, seed=27)
    body = bytearray(spoiled[1].payload)
    body[-1] ^= 0xFF  # the checksum catches it; its child is refused as parent_rejected
    spoiled[1] = ChunkRecord(spoiled[1].key, spoiled[1].parent, spoiled[1].ns, bytes(body))
    sent = sum(len(x.payload) for x in fp8 + good + spoiled)
    with KVStoreClient(f"127.0.0.1:{port}", DIRECT) as putter:
        assert putter.put(fp8).stored == 1  # a real-sized chunk, in parts
        assert putter.put(good).stored == 2
        assert putter.put(spoiled).stored == 1
        # read as soon as each answer is in: a call is reported before it is answered
        assert _scraped(r, "kvstore_put_process_calls_total", code="OK") == 3
    assert _scraped(r, "kvstore_rpc_total", method="Put", code="OK") == 3
    assert _scraped(r, "kvstore_rpc_duration_seconds_count", method="Put") == 3
    assert _put_calls(r) == 0
    assert _scraped(r, "kvstore_wire_bytes_total", direction="in") == sent
    # refused in the put process, before the store saw them: counted as the store's own
    assert _scraped(r, "kvstore_store_rejected_total", reason="bad_payload") == 1
    assert _scraped(r, "kvstore_store_rejected_total", reason="parent_rejected") == 1
    assert r.server.store.stats().rejected == {"bad_payload": 1, "parent_rejected": 1}
    # its part buffer for the real-sized chunk is kept there for the next put, and shown
    assert _scraped(r, "kvstore_put_buffers_pooled_bytes") >= FP8_BYTES
    assert r.server.service.part_buffers.pooled_bytes == 0  # the store's own hold nothing
    # a dead put process holds nothing any more; its calls stay counted
    old = r.put_process.pid
    os.kill(old, signal.SIGKILL)
    _wait_port(r, old=port)
    assert _scraped(r, "kvstore_put_buffers_pooled_bytes") == 0
    assert _scraped(r, "kvstore_put_process_calls_total", code="OK") == 3


def test_only_put_is_served_there(running):
    r = running()
    port = _wait_port(r)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        lookup = channel.unary_unary(
            f"/{SERVICE}/Lookup", pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as err:
            lookup(pb.LookupRequest(keys=[b"k" * 16]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_put_process_killed_mid_stream_leaves_nothing_behind_and_is_restarted(running):
    r = running()
    port = _wait_port(r)
    store = r.server.store
    fp8, _ = llama_chains(6, seed=24)
    outcome: list[object] = []

    def put_all() -> None:
        with KVStoreClient(f"127.0.0.1:{port}", DIRECT) as putter:
            try:
                outcome.append(putter.put(fp8))
            except Exception as exc:  # the put process died under it
                outcome.append(exc)

    putting = threading.Thread(target=put_all)
    putting.start()
    deadline = time.monotonic() + 60
    while len(store.index) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    old = r.put_process.pid
    os.kill(old, signal.SIGKILL)  # with the first chunk in, the next ones in flight
    putting.join(60)
    assert isinstance(outcome[0], Exception) or outcome[0].stored < 6
    new_port = _wait_port(r, old=port)
    assert r.put_process.pid not in (None, old) and r.put_process.restarts == 1
    scraped = r.server.service.metrics.registry.get_sample_value
    assert (scraped("kvstore_put_process_up"), scraped("kvstore_put_process_restarts")) == (1, 1)
    # nothing held for the dead process: no room, no claim, nothing in LMDB unindexed
    assert store._tickets == {} and store._claims == {}
    assert _lmdb_orphans(store) == []
    stored = len(store.index)
    assert 1 <= stored < 6
    assert store.index.used[0] == sum(store.tiers[0].cost(FP8_BYTES) for _ in range(stored))
    with KVStoreClient(f"127.0.0.1:{new_port}", DIRECT) as putter:
        result = putter.put(fp8)
    assert (result.stored, result.duplicates) == (6 - stored, stored)
    with KVStoreClient(r.address) as client:
        assert [bytes(p) for p in client.get(keys_of(fp8))] == payloads_of(fp8)


def test_a_store_killed_with_sigkill_takes_its_put_process_with_it(tmp_path):
    config = store_config(tmp_path / "kvstore.yaml", tmp_path / "lmdb")
    served = Served([KVSTORE, "serve", "--config", str(config)])
    try:
        deadline = time.monotonic() + 60
        while not (children := _children(served.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) == 1
    finally:
        served.kill()
    deadline = time.monotonic() + 30
    while _alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(children[0])


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def test_a_store_stopped_while_its_put_process_starts_leaves_no_child_behind(tmp_path):
    """stop() can come before, while or after the supervisor starts the child; in every
    case the child is ended and the supervisor finishes (it once waited for ever)."""
    for i in range(3):
        r = app.start(_config(tmp_path / f"lmdb{i}"))
        time.sleep(0.05 * i)
        r.stop()
        supervisor = r.put_process._threads[1]
        assert not supervisor.is_alive()
        proc = r.put_process._proc
        assert proc is None or proc.poll() is not None


def test_the_put_process_answers_only_to_the_store_s_tenants_over_its_tls(tmp_path):
    """Its port is as guarded as the store's: TLS with the store's certificate, the
    store's tenants; a tenant's chunks stay that tenant's, and another tenant putting the
    same keys gets a refusal, not the first one's chunks overwritten."""
    pki = make_pki(tmp_path / "pki")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump(
            {"tenants": [{"name": n, "tokens": [TOKENS[n]]} for n in ("team-a", "team-b")]}
        )
    )
    r = app.start(
        _config(
            tmp_path / "lmdb",
            **{
                "server.tls_cert": pki.server_cert,
                "server.tls_key": pki.server_key,
                "server.tenants_file": str(tenants),
            },
        )
    )
    try:
        port = _wait_port(r)

        def client(address: str, who: str | None) -> KVStoreClient:
            auth = ClientAuth(ca=pki.ca, token=TOKENS[who] if who else "")
            return KVStoreClient(address, ClientOptions(timeout_s=30.0, auth=auth))

        records = chain(3, seed=31)
        with client(f"localhost:{port}", None) as anonymous, pytest.raises(ClientError) as refused:
            anonymous.put(records)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        store = f"localhost:{r.server.port}"
        with client(store, "team-a") as a, client(store, "team-b") as b:
            assert a.put(records).stored == 3
            assert _put_calls(r) == 0  # it went to the put process, over TLS, with the token
            theirs = b.put(records)  # the same keys, another tenant
            assert theirs.stored == 0 and len(theirs.rejected) == 3
            assert b.lookup(keys_of(records)).matched == 0
            assert a.lookup(keys_of(records)).matched == 3
            assert [bytes(p) for p in a.get(keys_of(records))] == payloads_of(records)
    finally:
        r.stop()
