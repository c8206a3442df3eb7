"""Three real `kvstore serve` shards behind one ShardedClient: chains spread over all of
them, a lookup asks only its chain's shard, a killed shard turns its chains into misses
(no errors, no hangs) while the others keep hitting, and `kvstore stats` shows every
shard; leases go back to the shard that granted them."""

from __future__ import annotations

import itertools
import subprocess

from kvstore.client import ClientOptions
from kvstore.client.shards import ShardedClient
from kvstore.server.tiers.shm_region import reclaim_stale
from tests.chunks import chain, keys_of, payloads_of, pick_per_shard
from tests.procs import KVSTORE, Served, store_config


def test_three_shards_spread_chains_and_survive_losing_one(tmp_path):
    shards = []
    try:  # a shard that fails to start leaves none of the others running
        for i in range(3):
            cfg = store_config(tmp_path / f"s{i}.yaml", tmp_path / f"lmdb{i}", dram="16MiB")
            shards.append(Served([KVSTORE, "serve", "--config", str(cfg)]))
        spec = ",".join(s.address for s in shards)
        candidates = (chain(2, seed=seed) for seed in itertools.count(100))
        chains = pick_per_shard(spec, 10, candidates, lambda c: c[0].key)
        with ShardedClient(spec, ClientOptions(timeout_s=2.0, retries=0)) as client:
            result = client.put([r for c in chains for r in c])
            assert (result.stored, result.rejected) == (60, [])
            assert [s.chunks for _, s in client.stats()] == [20, 20, 20]
            for c in chains:  # each chain whole on exactly one shard
                assert client.lookup(keys_of(c)).matched == 2
                assert [bytes(p) for p in client.get(keys_of(c))] == payloads_of(c)
                homes = [s.lookup(keys_of(c)).matched for s in client.shards]
                assert sorted(homes) == [0, 0, 2]
            # leases taken on every shard go back to the shard that granted them, from the
            # background (as the connector's scheduler half ends them)
            leases = [client.lookup(keys_of(c), lease_ttl_s=30).lease_id for c in chains]
            assert all(leases) and sum(s.active_leases for _, s in client.stats()) == 30
            for lease in leases:
                client.release_later(lease)
            assert client.wait_releases(10)
            assert [s.active_leases for _, s in client.stats()] == [0, 0, 0]

            done = subprocess.run(
                [KVSTORE, "stats", "--address", spec], capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0 and "3 of 3 shards up" in done.stdout

            shards[1].kill()
            lost = [c for c in chains if client.shard_of(c[0].key) == 1]
            kept = [c for c in chains if client.shard_of(c[0].key) != 1]
            assert lost and kept
            for c in lost:  # misses, not errors
                assert client.lookup(keys_of(c)).matched == 0
                assert client.get(keys_of(c)) == []
            for c in kept:
                assert client.lookup(keys_of(c)).matched == 2
            new = chain(2, seed=999)
            res = client.put(new)
            assert res.stored + len(res.rejected) == 2  # stored, or refused as unavailable
            done = subprocess.run(
                [KVSTORE, "stats", "--address", spec], capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 1 and "2 of 3 shards up" in done.stdout
            assert f"{shards[1].address}: DOWN" in done.stdout
    finally:
        for s in shards:
            if s.proc.poll() is None:
                s.stop()
        reclaim_stale()  # the killed shard's shared memory, as its restart would
