"""The store under random puts, gets, deletes, leases and restarts: never wrong bytes.

A model remembers every payload ever put. Whatever the store returns must be
exactly those bytes, in chain order; with write-through nothing that fits on
disk is lost across restarts.
"""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvstore.server.store import TieredStore
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier
from tests.chunks import CHUNK_COST, chain

SLOT = CHUNK_COST
CHAINS = [chain(4, seed=s) for s in range(6)]
PAYLOADS = {r.key: r.payload for c in CHAINS for r in c}


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-sm-")
        self.policy = "write_through"
        self.store = self._open()
        self.leases: list[int] = []
        self.durable: set[bytes] = set()

    def _open(self):
        tiers = [DramTier(5 * SLOT), NvmeTier(self.dir, 64 << 20)]
        return TieredStore(tiers, write_policy=self.policy)

    @rule(c=st.integers(0, len(CHAINS) - 1), n=st.integers(1, 4))
    def put(self, c, n):
        records = CHAINS[c][:n]
        result = self.store.put(records)
        assert result.rejected == []
        self.durable |= {r.key for r in records}

    @rule(c=st.integers(0, len(CHAINS) - 1))
    def get(self, c):
        keys = [r.key for r in CHAINS[c]]
        got = self.store.get(keys)
        assert [bytes(p) for p in got] == [PAYLOADS[k] for k in keys[: len(got)]]
        # nvme is large enough for everything, so every durable prefix chunk comes back
        expected = 0
        while expected < len(keys) and keys[expected] in self.durable:
            expected += 1
        assert len(got) == expected

    @rule(c=st.integers(0, len(CHAINS) - 1), lease=st.booleans())
    def lookup(self, c, lease):
        keys = [r.key for r in CHAINS[c]]
        found = self.store.lookup(keys, lease_ttl_s=60 if lease else None)
        if found.lease_id is not None:
            self.leases.append(found.lease_id)
        assert all(k in self.durable for k in keys[: found.matched])

    @precondition(lambda self: self.leases)
    @rule()
    def release(self):
        self.store.release(self.leases.pop())

    @rule(c=st.integers(0, len(CHAINS) - 1), i=st.integers(0, 3))
    def delete(self, c, i):
        self.store.delete([CHAINS[c][i].key])
        self.durable -= {r.key for r in CHAINS[c][i:]}

    @rule()
    def restart(self):
        self.store.close()
        self.store = self._open()
        self.leases = []

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreMachine = StoreMachine.TestCase
