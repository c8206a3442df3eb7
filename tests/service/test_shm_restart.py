"""kill -9 a real `kvstore serve` and start it again on the same data, several times:
every acknowledged chunk reads back byte-identical over TCP and shared memory, the
killed stores' regions do not pile up in /dev/shm, and a client that lives through a
restart maps the new store's region and lets go of the old one."""

from __future__ import annotations

import signal
from pathlib import Path

from kvstore.client import ClientOptions, KVStoreClient
from kvstore.rpc.pb import pb
from tests.chunks import chain
from tests.procs import KVSTORE, Served, free_port, store_config
from tests.service.conftest import keys_of, payloads_of
from tests.shm_regions import held, mapped_here, regions

RESTARTS = 4
# generous: a call right after a restart waits out the channel's reconnect backoff
PATIENT = ClientOptions(timeout_s=30.0, retries=10)


def serve_argv(tmp_path: Path, port: int) -> list[str]:
    cfg = store_config(tmp_path / "kvstore.yaml", tmp_path / "lmdb", dram="64MiB")
    return [KVSTORE, "serve", "--config", str(cfg), "--server.listen", f"127.0.0.1:{port}"]


def region_of(stub, key: bytes) -> str:
    """The region a store serves ``key`` from (a chunk its dram tier holds)."""
    batch = stub.get_shm(pb.GetShmRequest(keys=[key]))
    assert len(batch.handles) == 1, "the chunk is not in shared memory"
    stub.release(pb.ReleaseRequest(lease_id=batch.lease_id))
    return batch.handles[0].region


def test_kill_9_then_restart_keeps_every_chunk_and_one_region(tmp_path, raw_stub):
    argv = serve_argv(tmp_path, free_port())
    chains: list[list] = []  # each acknowledged whole before a kill
    ours: list[str] = []  # the region of each store started here
    for start in range(RESTARTS + 1):
        served = Served(argv)
        try:
            with KVStoreClient(served.address, PATIENT) as client:
                for records in chains:  # back from LMDB over TCP, which also promotes them
                    assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
                records = chain(8, seed=100 + start)
                assert client.put(records).stored == 8
                chains.append(records)
                for records in chains:
                    got = client.get(keys_of(records), shm=True)
                    assert [bytes(p) for p in got] == payloads_of(records)
                # all of it out of shared memory, each copy checked (lease, key, length)
                assert (client.shm_stats.chunks, client.shm_stats.dropped) == (8 * len(chains), 0)

            region = region_of(raw_stub(served.address), chains[0][0].key)
            assert held(region)  # the store locks its region while it lives
            ours.append(region)
            # the killed stores' regions were reclaimed when this one started
            assert set(ours) & regions() == {region}
        finally:
            if start < RESTARTS:
                served.kill()
            else:
                code, err = served.stop()
        assert not held(region)  # dead: the next store to start may remove it
    assert code == 0, err
    assert len(set(ours)) == RESTARTS + 1
    assert not set(ours) & regions()  # a clean stop removes its own


def test_a_client_maps_the_restarted_stores_region_and_unmaps_the_old(tmp_path, raw_stub):
    port = free_port()
    argv = serve_argv(tmp_path, port)
    records = chain(4, seed=200)
    served = Served(argv)
    try:
        with KVStoreClient(f"127.0.0.1:{port}", PATIENT) as client:
            assert client.put(records).stored == 4
            assert [bytes(p) for p in client.get(keys_of(records), shm=True)] == payloads_of(
                records
            )
            old = region_of(raw_stub(served.address), records[0].key)
            assert old in mapped_here()

            served.kill()
            served = Served(argv)
            assert old not in regions()  # reclaimed by the new store

            # the first read finds the chunks in LMDB only and promotes them; the second
            # gets handles into the new region
            for _ in range(2):
                got = client.get(keys_of(records), shm=True)
                assert [bytes(p) for p in got] == payloads_of(records)
            new = region_of(raw_stub(served.address), records[0].key)
            assert new != old
            assert (client.shm_stats.regions_mapped, client.shm_stats.dropped) == (2, 0)
            assert new in mapped_here() and old not in mapped_here()
    finally:
        if served.proc.poll() is None:
            served.stop()  # SIGTERM: the store removes its region (kill would leave it)


def test_a_store_whose_output_nobody_reads_still_stops_cleanly(tmp_path, raw_stub):
    """Its supervisor gone (the pipes of its stdout and stderr closed), a SIGTERM still stops
    the store the clean way: exit status 0, its region unlinked, what it stored there on
    disk for the next store. Printing its last status line used to raise BrokenPipeError
    and skip the whole shutdown."""
    argv = serve_argv(tmp_path, free_port())
    records = chain(8, seed=300)
    served = Served(argv)
    try:
        with KVStoreClient(served.address, PATIENT) as client:
            assert client.put(records).stored == 8
        region = region_of(raw_stub(served.address), records[0].key)
        served.proc.stdout.close()
        served.proc.stderr.close()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0
    finally:
        if served.proc.poll() is None:
            served.kill()
    assert region not in regions()
    served = Served(argv)
    try:
        with KVStoreClient(served.address, PATIENT) as client:
            assert [bytes(p) for p in client.get(keys_of(records))] == payloads_of(records)
    finally:
        served.stop()
