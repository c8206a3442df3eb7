"""A chunk's payload put in parts (``PutChunk.total_length`` then ``PutRequest.part``)
is stored byte-identical to one put whole, and a part sequence that lies about its size
is refused with a message that says how, with nothing of that chunk stored."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import AsyncKVStoreClient, ClientOptions, KVStoreClient
from kvstore.core import wire
from kvstore.server.metrics import Metrics
from kvstore.server.part_buffers import ROUND
from kvstore.server.service import Limits
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of
from tests.service.test_disconnect import wait_until

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("part_bytes", [36, 5000, 1 << 20])
def test_parts_reassemble_byte_identical(served, part_bytes):
    records = chain(3, seed=1)  # 32 KiB + 36 B payloads: parts end short or exact
    with KVStoreClient(
        served.address, ClientOptions(put_part_bytes=part_bytes, put_split_bytes=0)
    ) as c:
        result = c.put(records)
        assert (result.stored, result.duplicates, result.rejected) == (3, 0, [])
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
        assert c.put(records).duplicates == 3


def test_chunks_put_in_parts_share_one_reused_buffer_and_each_reads_back_whole(served):
    """Each chunk is gathered in the buffer the last one used (no page faults for it),
    which the store must have copied out of: every chunk reads back its own bytes."""
    records = chain(6, seed=11)  # distinct payloads of one size, so one buffer fits all
    pool = served.server.service.part_buffers
    with KVStoreClient(served.address, ClientOptions(put_part_bytes=5000, put_split_bytes=0)) as c:
        assert c.put(records).stored == 6
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
    assert (pool.fresh, pool.reused, pool.dropped) == (1, 5, 0)


def test_parts_are_cut_in_bytes_whatever_the_payload_buffer_s_item_size(served):
    records = chain(2, seed=8)
    wide = [  # the same bytes as 2-byte items: slicing the view would count items
        dataclasses.replace(r, payload=memoryview(np.frombuffer(r.payload, np.uint16)))
        for r in records
    ]
    with KVStoreClient(served.address, ClientOptions(put_part_bytes=5000, put_split_bytes=0)) as c:
        assert c.put(wide).stored == 2
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_the_async_client_puts_in_parts_too(served):
    records = chain(3, seed=7)

    async def scenario() -> None:
        opts = ClientOptions(put_part_bytes=5000, put_split_bytes=0)
        async with AsyncKVStoreClient(served.address, opts) as c:
            assert (await c.put(records)).stored == 3
            assert [bytes(p) for p in await c.get(keys_of(records))] == payloads_of(records)

    asyncio.run(scenario())


def test_whole_chunks_of_older_clients_are_still_accepted(served):
    records = chain(3, seed=2)
    with KVStoreClient(served.address, ClientOptions(put_part_bytes=0)) as c:
        assert c.put(records).stored == 3
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def first_part(records, cut: int, total: int | None = None) -> bytes:
    """A PutRequest of ``records`` whose last payload is cut after ``cut`` bytes."""
    *whole, last = records
    payload = memoryview(last.payload)
    head = type(last)(last.key, last.parent, last.ns, payload[:cut])
    return wire.encode_put_request([*whole, head], total_length=total or payload.nbytes)


def refused(stub, messages) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.put(iter(messages), timeout=10)
    assert err.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    return err.value


def rest(records, cut: int) -> bytes:
    return wire.encode_put_part(memoryview(records[-1].payload)[cut:])


def test_parts_that_lie_about_the_size_are_refused_and_nothing_of_the_chunk_is_stored(
    served, raw_stub
):
    records = chain(2, seed=3)
    size = len(records[-1].payload)
    stub = raw_stub(served.address)
    cases = {
        "add up to more than": [first_part(records, 100, size - 1), rest(records, 100)],
        f"ended after 100 of its total_length of {size}": [first_part(records, 100)],
        "ended after 100": [first_part(records, 100), wire.encode_put_request(chain(1, seed=4))],
        "its first part alone": [first_part(records, size - 1, 10)],
        "no chunk sent in parts before it": [wire.encode_put_part(b"x" * 10)],
    }
    for text, messages in cases.items():
        err = refused(stub, messages)
        assert err.code() == INVALID and text in err.details(), (text, err.details())
        assert "malformed PutRequest" in err.details()
        with KVStoreClient(served.address) as c:
            # records[0] went whole with the first lying part and is kept; records[1] never
            assert c.lookup(keys_of(records)).matched == 1
    with KVStoreClient(served.address) as c:  # the server keeps serving
        assert c.put(records).stored == 1
        assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)


def test_max_chunk_bytes_applies_to_the_whole_payload_before_any_part_is_kept(serve, raw_stub):
    records = chain(1, seed=5)
    size = len(records[0].payload)
    served = serve(limits=Limits(max_chunk_bytes=size - 1))
    err = refused(raw_stub(served.address), [first_part(records, 100)])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"is {size} bytes; max_chunk_bytes is {size - 1}" in err.details()


def held_after_first_part(stub, records) -> tuple[grpc.Future, threading.Event]:
    """A Put of ``records`` that sends the last chunk's first 100 bytes, then waits for
    the returned event before sending the rest; returns once the first part is handed to
    gRPC (which does not mean the server has read it)."""
    first_sent, go = threading.Event(), threading.Event()

    def slow():
        yield first_part(records, 100)
        first_sent.set()
        go.wait(10)
        yield rest(records, 100)

    held = stub.put.future(slow(), timeout=20)
    assert first_sent.wait(10)
    return held, go


def test_a_payload_in_parts_holds_all_its_bytes_in_flight_from_its_first_part(serve, raw_stub):
    records = chain(1, seed=5)
    size = len(records[0].payload)
    served = serve(limits=Limits(max_inflight_bytes_per_client=size + 100))
    stub = raw_stub(served.address)
    held, go = held_after_first_part(stub, records)
    # the generator handing over its first part does not mean the server has read it
    wait_until(lambda: served.server.service.quotas.inflight_bytes() == size, timeout_s=10)
    other = chain(1, seed=6)
    try:
        err = refused(stub, [wire.encode_put_request(other)])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight_bytes_per_client" in err.details()
    finally:
        go.set()
    assert held.result().stored == 1
    with KVStoreClient(served.address) as c:
        assert c.put(other).stored == 1  # the quota came back with the stored chunk


def test_by_default_only_chunks_over_4_mib_go_in_parts_of_1_mib():
    """The store's server holds its GIL while it builds each received message: no message of
    a large chunk's put may be much over 1 MiB, while chunks up to 4 MiB still travel whole."""
    from kvstore.client.grpc_client import _batches, _encoded

    opts = ClientOptions()
    small, large = chain(2, seed=3), chain(1, seed=4)
    big = dataclasses.replace(large[0], payload=bytes(9 << 20) + b"tail")
    mid = dataclasses.replace(small[0], payload=bytes(3 << 20))

    def sizes(records):
        batches = _batches(records, opts.put_batch_bytes)
        return [len(m) for m in _encoded(batches, opts.put_part_bytes, opts.put_split_bytes)]

    assert len(sizes([mid])) == 1  # whole, in one message
    parts = sizes([big])
    assert len(parts) == 10  # 9 MiB and 4 bytes: nine 1 MiB parts and the tail
    assert max(parts) < (1 << 20) + 4096
    assert sum(parts) >= (9 << 20) + 4


def _vm_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping of this process that holds ``address``."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = set(line.split()[1:])
    assert flags is not None, "no mapping holds the address"
    return flags


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no THP in this kernel"
)
def test_a_chunk_in_parts_is_gathered_outside_transparent_huge_pages():
    """numpy asks for huge pages on a large array ('hg'); the parts' buffer refuses them
    ('nh'): a huge page fault may compact memory and stall every thread of the store."""
    from kvstore.server.part_buffers import small_pages

    big = np.empty(32 << 20, np.uint8)
    parts = small_pages(32 << 20)
    parts[:] = 1
    middle = 16 << 20  # numpy advises only the 2 MiB-aligned inside of its allocation
    assert {"nh", "hg", "sh"} & _vm_flags(parts.ctypes.data + middle) == {"nh"}
    assert "nh" not in _vm_flags(big.ctypes.data + middle)


def _gauge(metrics: Metrics, name: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not exported")


def test_put_bytes_in_flight_and_idle_part_buffers_are_on_metrics(serve, open_store, raw_stub):
    store = open_store()
    metrics = Metrics(store.stats)
    served = serve(store, metrics=metrics)
    records = chain(1, seed=12)
    size = len(records[0].payload)
    held, go = held_after_first_part(raw_stub(served.address), records)
    try:
        wait_until(lambda: _gauge(metrics, "kvstore_put_inflight_bytes") == size, timeout_s=10)
        assert _gauge(metrics, "kvstore_put_buffers_pooled_bytes") == 0  # the buffer is lent
    finally:
        go.set()
    assert held.result().stored == 1
    assert _gauge(metrics, "kvstore_put_inflight_bytes") == 0
    assert _gauge(metrics, "kvstore_put_buffers_pooled_bytes") == ROUND  # back, whole MiB
