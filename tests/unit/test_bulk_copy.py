"""The streamed copy (kvstore/core/stream_copy.c through bulk_copy): every byte lands,
nothing outside the destination is touched, and without a compiler copies still happen."""

import logging
import os
import platform
import shutil

import numpy as np
import pytest

from kvstore.core import bulk_copy, native

STREAMS_HERE = platform.machine() in ("x86_64", "AMD64") and native._compiler() is not None


@pytest.mark.skipif(not STREAMS_HERE, reason="streaming stores need x86-64 and a C compiler")
def test_an_x86_host_with_a_compiler_streams_large_batches_and_not_small_ones():
    assert bulk_copy.load() is not None
    assert bulk_copy.streamer(bulk_copy.STREAM_MIN) is not None
    assert bulk_copy.streamer(bulk_copy.STREAM_MIN - 1) is None
    assert bulk_copy.copier(4096) is bulk_copy._plain
    assert bulk_copy.uncached_copier() is not bulk_copy._plain  # nobody reads it soon


@pytest.mark.skipif(not STREAMS_HERE, reason="streaming stores need x86-64 and a C compiler")
@pytest.mark.parametrize("length", [0, 1, 63, 64, 127, 128, 129, 4095, (1 << 20) + 17])
def test_streamed_copies_of_any_length_and_alignment_land_exactly(length):
    copy = bulk_copy.streamer(bulk_copy.STREAM_MIN)
    rng = np.random.default_rng(length)
    src_pool = rng.integers(0, 256, length + 128, dtype=np.uint8)
    for dest_at, src_at in [(0, 0), (1, 0), (31, 5), (63, 64), (64, 3), (17, 17)]:
        dest_pool = np.full(length + 256, 0xA5, dtype=np.uint8)
        src = src_pool[src_at : src_at + length]
        copy(dest_pool[dest_at : dest_at + length], src)
        assert np.array_equal(dest_pool[dest_at : dest_at + length], src), (dest_at, src_at)
        assert (dest_pool[:dest_at] == 0xA5).all() and (dest_pool[dest_at + length :] == 0xA5).all()


@pytest.mark.skipif(not STREAMS_HERE, reason="streaming stores need x86-64 and a C compiler")
def test_a_streamed_copy_refuses_mismatched_or_read_only_buffers():
    copy = bulk_copy.streamer(bulk_copy.STREAM_MIN)
    src = np.arange(256, dtype=np.uint8)
    with pytest.raises(ValueError, match="copy of 256 B"):
        copy(np.zeros(255, np.uint8), src)
    with pytest.raises(ValueError, match="copy of"):
        copy(np.zeros(64, np.uint32), src)
    frozen = np.zeros(256, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        copy(frozen, src)
    with pytest.raises(ValueError, match="contiguous"):
        copy(np.zeros(512, np.uint8)[::2], src)
    assert not frozen.any()


def test_without_a_compiler_copies_are_plain_and_right(tmp_path, monkeypatch, caplog):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bulk_copy, "_state", {})
    assert shutil.which("cc") is None
    with caplog.at_level(logging.INFO, logger="kvstore.core.bulk_copy"):
        assert bulk_copy.streamer(64 << 20) is None
        assert bulk_copy.uncached_copier() is bulk_copy._plain
        copy = bulk_copy.copier(64 << 20)
    assert "no C compiler" in caplog.text and os.environ["PATH"] == str(empty)
    src = np.arange(1000, dtype=np.uint8)
    dest = np.zeros(1000, np.uint8)
    copy(dest, src)
    assert np.array_equal(dest, src)
