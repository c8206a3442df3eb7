"""The typed clients: deadlines, retries on UNAVAILABLE, and the asyncio twin."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kvstore.client import AsyncKVStoreClient, ClientError, ClientOptions, KVStoreClient
from kvstore.grpc_server import StoreServer
from tests.chunks import chain
from tests.procs import free_port
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
    # three backoffs (0.05 + 0.1 + 0.2 s) were slept, and the deadline was kept
    assert 0.3 <= elapsed < 1.5


def test_a_call_made_before_the_server_starts_succeeds_by_retrying(open_store):
    port = free_port()
    server = StoreServer(open_store(), f"127.0.0.1:{port}", grace_s=1)
    records = chain(3, seed=2)
    opts = ClientOptions(timeout_s=5.0, retries=8, backoff_s=0.05)
    outcome: dict = {}
    with KVStoreClient(f"127.0.0.1:{port}", opts) as c:

        def put() -> None:
            try:
                outcome["result"] = c.put(records)
            except ClientError as exc:
                outcome["error"] = exc

        caller = threading.Thread(target=put)
        caller.start()
        time.sleep(0.3)  # the first attempts meet a closed port
        try:
            assert server.start() == port
            caller.join(5)
            assert outcome.get("error") is None and outcome["result"].stored == 3
            assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
        finally:
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
