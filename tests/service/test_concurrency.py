"""Many clients at once: eight threads, each with its own client and chains, for two seconds."""

from __future__ import annotations

import threading
import time

from kvstore.client import KVStoreClient
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of

THREADS = 8
SECONDS = 2.0


def test_eight_clients_put_lookup_and_get_their_own_chains(serve, open_store):
    # DRAM holds a third of what is written, so eviction and promotion run all along
    served = serve(open_store(dram_slots=32), workers=16)
    chains = [[chain(4, seed=t * 100 + i) for i in range(4)] for t in range(THREADS)]
    errors: list[BaseException] = []
    rounds = [0] * THREADS
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            with KVStoreClient(served.address) as c:
                start.wait()
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    records = chains[t][rounds[t] % len(chains[t])]
                    keys = keys_of(records)
                    result = c.put(records)
                    assert result.rejected == [] and result.stored + result.duplicates == 4
                    assert c.lookup(keys).matched == 4
                    shm = rounds[t] % 2 == 1
                    assert [bytes(p) for p in c.get(keys, shm=shm)] == payloads_of(records)
                    rounds[t] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(SECONDS + 30)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert all(n >= 4 for n in rounds), rounds  # every thread cycled through its chains

    with KVStoreClient(served.address) as c:
        stats = c.stats()
        assert stats.chunks == THREADS * 4 * 4
        assert stats.active_leases == 0
        dram, nvme = stats.tiers
        assert dram.evictions > 0 and dram.promotions_in > 0 and nvme.hits > 0
        for per_thread in chains:
            for records in per_thread:
                assert [bytes(p) for p in c.get(keys_of(records))] == payloads_of(records)
