"""The factory builds real tiers and a real store from a Config, and cleans up when it cannot."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvstore.server import factory
from kvstore.server.config import Config, ConfigError, DramConfig, HbmConfig, NvmeConfig
from kvstore.server.tiers.dram import DramTier
from tests.chunks import chain


@pytest.fixture
def config(tmp_path) -> Config:
    return Config(
        dram=DramConfig(capacity_bytes="1MiB"),
        nvme=NvmeConfig(path=str(tmp_path / "data" / "lmdb"), map_size="64MiB"),
    )


@pytest.fixture
def dram_spy(monkeypatch) -> list[DramTier]:
    """Every real DramTier the factory builds, so a test can check its region is gone."""
    built: list[DramTier] = []

    class RecordedDramTier(DramTier):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(factory, "DramTier", RecordedDramTier)
    return built


def test_tiers_come_fastest_first_and_the_lmdb_directory_is_created(config):
    tiers = factory.build_tiers(config)
    try:
        assert [t.name for t in tiers] == ["dram", "nvme"]
        assert tiers[0].capacity_bytes == 1 << 20
        assert os.path.isdir(config.nvme.path)
    finally:
        for t in tiers:
            t.close()


def test_a_chunk_put_through_the_store_survives_a_rebuild_from_the_same_config(config):
    (rec,) = chain(1)
    store = factory.build_store(config)
    assert store.put([rec]).stored == 1
    assert store.get([rec.key]) == [rec.payload]
    assert store.max_chunk_bytes == config.server.max_chunk_bytes
    store.close()

    store = factory.build_store(config)
    try:
        found = store.lookup([rec.key])
        assert found.matched == 1 and found.tiers == ["nvme"]
        assert bytes(store.get([rec.key])[0]) == rec.payload
    finally:
        store.close()


def test_one_tier_alone_makes_a_store(tmp_path):
    only_nvme = Config(
        dram=DramConfig(enabled=False), nvme=NvmeConfig(path=str(tmp_path), map_size="16MiB")
    )
    store = factory.build_store(only_nvme)
    try:
        assert [t.name for t in store.tiers] == ["nvme"]
    finally:
        store.close()


def test_a_tier_that_fails_closes_the_ones_built_and_names_the_key(tmp_path, dram_spy):
    not_a_dir = tmp_path / "lmdb"
    not_a_dir.write_text("a file where the LMDB directory should be")
    config = Config(
        dram=DramConfig(capacity_bytes="1MiB"),
        nvme=NvmeConfig(path=str(not_a_dir), map_size="16MiB"),
    )
    with pytest.raises(ConfigError, match=r"cannot build the nvme tier: .*nvme\.path") as e:
        factory.build_store(config)
    assert "nvme.enabled" in str(e.value) and e.value.__cause__ is not None
    (dram,) = dram_spy
    assert not os.path.exists(f"/dev/shm/{dram.region_name}")


def test_a_store_that_fails_to_start_closes_its_tiers(config, dram_spy, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("index rebuild failed")

    monkeypatch.setattr(factory, "TieredStore", refuse)
    with pytest.raises(RuntimeError, match="index rebuild failed"):
        factory.build_store(config)
    (dram,) = dram_spy
    assert not os.path.exists(f"/dev/shm/{dram.region_name}")


def _cuda_visible() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


@pytest.mark.skipif(_cuda_visible(), reason="this host has a GPU, so the hbm tier builds")
def test_hbm_without_a_gpu_is_a_config_error_naming_hbm(config):
    with_hbm = dataclasses.replace(config, hbm=HbmConfig(enabled=True, capacity_bytes="1MiB"))
    with pytest.raises(ConfigError, match=r"cannot build the hbm tier: .*hbm\.enabled to false"):
        factory.build_tiers(with_hbm)


def test_the_old_slot_bytes_key_is_accepted_and_ignored_with_a_warning(config, caplog):
    old = dataclasses.replace(config, dram=DramConfig(capacity_bytes="1MiB", slot_bytes="64KiB"))
    with caplog.at_level("WARNING", logger="kvstore.server.factory"):
        tiers = factory.build_tiers(old)
    try:
        assert "dram.slot_bytes is ignored" in caplog.text
        big = chain(1)[0]
        tiers[0].write([big])  # larger than the old 64 KiB "slot": fits all the same
        assert bytes(tiers[0].read([big.key])[0]) == big.payload
    finally:
        for t in tiers:
            t.close()
