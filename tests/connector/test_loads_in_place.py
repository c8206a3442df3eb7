"""Same-host loads read the store's shared memory in place: the decode and the copy into
the paged cache read the chunks where the store keeps them, under a lease, with no copy
of the connector's own; what they read is trusted only if, once the blocks are written,
every chunk's slot still holds its key and the lease held throughout. Real store server
on loopback, real shared memory."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from connector.layouts import CpuLayout
from connector.plan import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.client import KVStoreClient
from kvstore.core.keys import chunk_keys
from tests.connector.test_halves_with_store import (
    BLOCK,
    CHUNK,
    DIM,
    LAYERS,
    NS,
    paged_cache,
    store_address,  # noqa: F401  (fixture)
    worker,
)

SRC_BLOCKS = list(range(8))  # 4 chunks of 2 blocks


def saved(address: str, first_token: int):
    keys = chunk_keys(NS.digest(), list(range(first_token, first_token + 4 * CHUNK)), CHUNK)
    src = paged_cache(seed=first_token)
    saver = worker(address, src)
    saver.save(KVStoreMetadata(saves=[SaveSpec("s", keys, None, SRC_BLOCKS)]))
    assert saver.flush(10) and saver.counters.saved_chunks == 4
    saver.close()
    return keys, src


def same(src, dst, src_blocks, dst_blocks) -> bool:
    layout = CpuLayout(BLOCK, DIM)
    return all(
        torch.equal(a, b)
        for name in src
        for a, b in zip(layout.gather(src[name], src_blocks), layout.gather(dst[name], dst_blocks))
    )


def test_a_same_host_load_reads_the_region_in_place_and_lands_exactly(store_address):  # noqa: F811
    keys, src = saved(store_address, 100)
    dst = paged_cache(seed=1)
    w = worker(store_address, dst, transport="shm")
    for first_block in (0, 3):  # whole chunks (one strided batch), then from inside one
        w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, list(range(8, 16)), first_block)]))
        assert w.load_errors() == set()
        assert same(src, dst, SRC_BLOCKS[first_block:], list(range(8 + first_block, 16)))
    assert not w._staging  # no staging buffer: nothing was copied out first
    assert w.client.shm_stats.chunks == 8 and w.client.stats().active_leases == 0
    # the whole chunks were one strided batch of views of the region, chunk j's K and V
    # those of the payload that decode_many read for it
    fetched = w._fetch_decoded(LoadSpec("r", keys, list(range(8, 16)), 0), 0)
    k, v = fetched.stacked
    for j, (kj, vj) in enumerate(fetched.decoded):
        assert kj.data_ptr() == k[j].data_ptr() and vj.data_ptr() == v[j].data_ptr()
        assert torch.equal(kj, k[j]) and torch.equal(vj, v[j])
    assert fetched.views.end() == 4
    w.close()


def load_steps(w, spec: LoadSpec, between) -> set[int]:
    """The worker's own steps for one load, with ``between`` run after the fetch (views
    leased) and before the check that ends the lease."""
    fetched = w._fetch_decoded(spec, 0)
    assert fetched.views is not None  # read in place
    between(fetched.views)
    for layer in range(LAYERS):
        w._write_layer(fetched, layer)
    return w._settle(fetched)


def test_a_slot_that_changes_hands_during_the_load_is_not_trusted(store_address):  # noqa: F811
    keys, src = saved(store_address, 200)
    dst = paged_cache(seed=2)
    w = worker(store_address, dst, transport="shm")
    spec = LoadSpec("r", keys, list(range(8, 16)), 0)

    def reuse_third_slot(views) -> None:  # as a store reusing it would: another key there
        offset = views.offsets[2]
        with open(os.path.join("/dev/shm", views.batch.handles[2].region), "r+b") as f:
            f.seek(offset - 16)
            f.write(b"\xee" * 16)

    bad = load_steps(w, spec, reuse_third_slot)
    assert bad == {12, 13, 14, 15}  # the third and fourth chunks: recomputed
    assert same(src, dst, SRC_BLOCKS[:4], [8, 9, 10, 11])
    assert w.counters.loaded_chunks == 2 and w.counters.load_failures == 1
    assert w.client.shm_stats.key_mismatch == 1
    w.close()


def test_a_lease_that_may_have_lapsed_leaves_nothing_trusted(store_address):  # noqa: F811
    keys, _ = saved(store_address, 300)
    w = worker(store_address, paged_cache(seed=3), transport="shm")
    w.client.options = dataclasses.replace(w.client.options, shm_lease_ttl_s=0.05)
    spec = LoadSpec("r", keys, list(range(8, 16)), 0)

    def lapse(views) -> None:
        time.sleep(0.3)
        with KVStoreClient(store_address) as other:  # any call lets the store expire it
            other.lookup([bytes(16)])

    bad = load_steps(w, spec, lapse)
    assert bad == set(range(8, 16))
    assert w.client.shm_stats.lease_lapsed == 4 and w.counters.loaded_chunks == 0
    w.close()


def test_a_prefix_partly_outside_shared_memory_is_fetched_instead(store_address):  # noqa: F811
    """A chunk the store holds only on disk has no handle: the load copies through the
    staging buffer, as before, and still lands exactly."""
    keys, src = saved(store_address, 400)
    dst = paged_cache(seed=4)
    w = worker(store_address, dst, transport="shm")
    real = w.client.shm_views

    def without_the_last_handle(ks, timeout_s=None, grant=None):  # the fourth chunk on disk
        got = real(ks, timeout_s, grant)
        assert got is not None and len(got.views) == 4
        got.end()
        return None

    w.client.shm_views = without_the_last_handle
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, list(range(8, 16)), 0)]))
    assert w.load_errors() == set()
    assert same(src, dst, SRC_BLOCKS, list(range(8, 16)))
    assert w._staging  # copied out first
    assert w.client.shm_stats.chunks == 8  # 4 viewed then set aside, 4 by the copy's GetShm
    w.close()


def test_a_chunk_spoiled_in_the_stores_memory_is_recomputed_from_there_on(store_address):  # noqa: F811
    """The checksums run beside the copy into blocks; a chunk that fails its own leaves
    its blocks and the later ones to vLLM to recompute, and the earlier ones land."""
    keys, src = saved(store_address, 500)
    with KVStoreClient(store_address) as c:
        views = c.shm_views(keys)
        handle = views.batch.handles[2]
        region, offset, length = handle.region, handle.offset, handle.length
        views.end()
    with open(os.path.join("/dev/shm", region), "r+b") as f:  # one body byte of chunk 3
        f.seek(offset + length - 1)
        byte = f.read(1)
        f.seek(offset + length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    dst = paged_cache(seed=5)
    w = worker(store_address, dst, transport="shm")
    w.load(KVStoreMetadata(loads=[LoadSpec("r", keys, list(range(8, 16)), 0)]))
    assert w.load_errors() == {12, 13, 14, 15}
    assert same(src, dst, SRC_BLOCKS[:4], [8, 9, 10, 11])
    assert w.counters.loaded_chunks == 2 and w.counters.load_failures == 1
    assert w._check_pool is not None  # checked on the checksum thread, beside the writes
    w.close()
