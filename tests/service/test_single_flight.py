"""Single-flight prefill over the wire: Lookup with ``reserve_ttl_s`` makes the first
engine the producer of a new prefix and shows the rest of them that it is pending."""

from __future__ import annotations

import math

import grpc
import pytest

from kvstore.client import ClientError, KVStoreClient
from tests.chunks import chain
from tests.service.conftest import keys_of


def test_one_producer_the_others_see_pending_until_its_puts_land(served):
    records = chain(3, seed=11)
    keys = keys_of(records)
    with KVStoreClient(served.address) as a, KVStoreClient(served.address) as b:
        mine = a.lookup(keys, reserve_ttl_s=10, holder="engine-a")
        theirs = b.lookup(keys, reserve_ttl_s=10, holder="engine-b")
        assert (mine.reserved, mine.pending) == (3, 0)
        assert (theirs.reserved, theirs.pending) == (0, 3)
        assert b.stats().reservations == 3
        a.put(records)
        after = b.lookup(keys, reserve_ttl_s=10, holder="engine-b")
        assert (after.matched, after.pending, after.reserved) == (3, 0, 0)
        assert b.stats().reservations == 0


@pytest.mark.parametrize("ttl", [-1.0, math.nan, 1e9])
def test_a_bad_reservation_ttl_is_invalid_argument(client, ttl):
    with pytest.raises(ClientError) as err:
        client.lookup(keys_of(chain(1, seed=12)), reserve_ttl_s=ttl, holder="x")
    assert (
        err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "reserve_ttl_s" in err.value.details
    )
