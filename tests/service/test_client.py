"""The typed clients: deadlines, retries on UNAVAILABLE (gRPC's retryPolicy), the asyncio twin."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import grpc
import pytest

from kvstore.client import (
    AsyncKVStoreClient,
    ClientError,
    ClientOptions,
    KVStoreClient,
)
from kvstore.client.grpc_client import _channel_options
from kvstore.server.grpc_server import StoreServer
from tests.chunks import chain
from tests.procs import free_port
from tests.proxy import FaultyProxy
from tests.service.conftest import keys_of, payloads_of


def test_a_tiny_deadline_is_deadline_exceeded_and_not_retried(client):
    records = chain(30, seed=1)
    client.put(records)
    with pytest.raises(ClientError) as err:
        client.get(keys_of(records), timeout_s=0.0005)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.method == "Get"
    assert len(client.get(keys_of(records))) == 30


def test_a_closed_port_is_unavailable_within_the_timeout_after_retries():
    opts = ClientOptions(timeout_s=1.0, retries=3, backoff_s=0.05)
    with KVStoreClient(f"127.0.0.1:{free_port()}", opts) as c:
        t0 = time.monotonic()
        with pytest.raises(ClientError) as err:
            c.lookup([b"\x00" * 16])
        elapsed = time.monotonic() - t0
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "Lookup: UNAVAILABLE" in str(err.value)
    assert elapsed < 1.5  # every retry was made within the deadline


def test_the_retry_policy_names_only_idempotent_calls_and_is_gone_without_retries():
    options = dict(_channel_options(ClientOptions(retries=9, backoff_s=0.1)))
    (method,) = json.loads(options["grpc.service_config"])["methodConfig"]
    retried = {name["method"] for name in method["name"]}
    assert retried == {"Lookup", "Get", "GetShm", "Put", "ReserveShm", "Delete", "Stats"} | {
        "Explain",
        "Routes",
        "Check",
    }
    assert "Release" not in retried and "CommitShm" not in retried
    policy = method["retryPolicy"]
    assert policy["maxAttempts"] == 5  # gRPC's ceiling, not 10
    assert (policy["initialBackoff"], policy["maxBackoff"]) == ("0.100000000s", "0.800000000s")
    assert options["grpc.per_rpc_retry_buffer_size"] == ClientOptions().max_message_bytes
    assert "grpc.service_config" not in dict(_channel_options(ClientOptions(retries=0)))
    with pytest.raises(ValueError, match="backoff_s"):
        ClientOptions(backoff_s=0)


def test_a_store_slower_to_shake_hands_than_100_ms_is_still_reached(client, served):
    """gRPC takes ``grpc.min_reconnect_backoff_ms`` as the time one connection attempt may
    take. At the 100 ms the client once set, a store whose handshake took longer (a loaded
    host, TLS over a long link) failed every call UNAVAILABLE, whatever its deadline."""
    records = chain(3, seed=7)
    client.put(records)
    proxy = FaultyProxy(int(served.address.rsplit(":", 1)[1]))
    proxy.delay_s, proxy.mode = 0.3, "delay"  # every read, both ways: a handshake of >= 0.6 s
    try:
        target = f"127.0.0.1:{proxy.port}"
        # gRPC only: the store's same-host socket would go around the proxy
        grpc_only = ClientOptions(timeout_s=10.0, retries=0, local_calls=False)
        with KVStoreClient(target, grpc_only) as slow:
            assert slow.lookup(keys_of(records)).matched == 3
        short = dataclasses.replace(grpc_only, connect_timeout_s=0.2)
        with KVStoreClient(target, short) as hasty, pytest.raises(ClientError) as err:
            hasty.lookup(keys_of(records))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "SETTINGS" in str(err.value)  # the attempt timed out, not the call
    finally:
        proxy.close()
    with pytest.raises(ValueError, match="connect_timeout_s"):
        ClientOptions(connect_timeout_s=0.05)


def start_later(server: StoreServer, delay_s: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay_s, server.start)
    timer.start()
    return timer


@pytest.mark.parametrize("retries", [4, 0])
def test_a_put_made_before_the_server_starts_succeeds_by_retrying(open_store, retries):
    port = free_port()
    server = StoreServer(open_store(), f"127.0.0.1:{port}", grace_s=1)
    records = chain(16, seed=2)  # 512 KiB: more than gRPC's default 256 KiB retry buffer
    opts = ClientOptions(timeout_s=10.0, retries=retries, backoff_s=0.2)
    timer = start_later(server)  # the first attempt meets a closed port
    try:
        with KVStoreClient(f"127.0.0.1:{port}", opts) as c:
            if not retries:
                with pytest.raises(ClientError) as err:
                    c.put(records)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                return
            assert c.put(records).stored == 16
            assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
    finally:
        timer.join()
        server.stop()


def test_an_async_call_made_before_the_server_starts_succeeds_by_retrying(open_store):
    port = free_port()
    server = StoreServer(open_store(), f"127.0.0.1:{port}", grace_s=1)
    records = chain(3, seed=4)

    async def scenario() -> None:
        opts = ClientOptions(timeout_s=10.0, retries=4, backoff_s=0.2)
        async with AsyncKVStoreClient(f"127.0.0.1:{port}", opts) as c:
            assert (await c.put(records)).stored == 3
            assert (await c.stats()).chunks == 3

    timer = start_later(server)
    try:
        asyncio.run(scenario())
    finally:
        timer.join()
        server.stop()


def test_async_client_round_trip(served):
    records = chain(4, seed=3)

    async def scenario() -> None:
        async with AsyncKVStoreClient(served.address) as c:
            result = await c.put(records)
            assert (result.stored, result.duplicates, result.rejected) == (4, 0, [])
            assert (await c.put(records[:2])).duplicates == 2

            found = await c.lookup(keys_of(records), lease_ttl_s=30)
            assert found.matched == 4 and found.tiers == ["dram"] * 4 and found.lease_id
            assert (await c.stats()).active_leases == 1
            await c.release(found.lease_id)

            got = await asyncio.gather(*(c.get(keys_of(records)) for _ in range(4)))
            for payloads in got:
                assert [bytes(p) for p in payloads] == payloads_of(records)

            stats = await c.stats()
            assert stats.chunks == 4 and stats.put_chunks == 4 and stats.active_leases == 0

            with pytest.raises(ClientError) as err:
                await c.lookup([b"short"])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(ClientError) as err:
                await c.release(424242)
            assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_async_client_against_a_closed_port_is_unavailable():
    async def scenario() -> None:
        opts = ClientOptions(timeout_s=1.0, retries=1)
        async with AsyncKVStoreClient(f"127.0.0.1:{free_port()}", opts) as c:
            with pytest.raises(ClientError) as err:
                await c.stats()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())
