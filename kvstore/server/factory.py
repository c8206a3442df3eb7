"""Builds the tiers and the store that a ``Config`` describes.

Offers ``build_tiers(config)`` (hbm, dram, nvme in that order, only the enabled ones) and
``build_store(config)``. When a tier cannot be built, the tiers already built are closed,
never left open (a dram region left in ``/dev/shm`` would outlive the process), and a
``ConfigError`` names the config keys to change, with the tier's own error as its cause.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from kvstore.server.config import Config, ConfigError, DramConfig, HbmConfig, NvmeConfig
from kvstore.server.store import TieredStore
from kvstore.server.tiers.base import Tier
from kvstore.server.tiers.dram import DramTier
from kvstore.server.tiers.nvme import NvmeTier

log = logging.getLogger(__name__)


def _hbm(c: HbmConfig) -> Tier:
    # Imported here so that a host with the hbm tier disabled never loads the GPU code.
    from kvstore.server.tiers.hbm import HbmTier

    _warn_slot_bytes(c)
    return HbmTier(c.capacity_bytes, device=c.device)


def _dram(c: DramConfig) -> Tier:
    _warn_slot_bytes(c)
    return DramTier(c.capacity_bytes)


def _warn_slot_bytes(c: DramConfig | HbmConfig) -> None:
    if c.slot_bytes:
        log.warning(
            "%s.slot_bytes is ignored: chunks of any size share the %s region; remove it",
            c.SECTION,
            c.SECTION,
        )


def _nvme(c: NvmeConfig) -> Tier:
    os.makedirs(c.path, exist_ok=True)
    return NvmeTier(
        c.path, c.map_size, compression=c.compression, zstd_level=c.zstd_level, sync=c.sync
    )


_PLAN: list[tuple[str, Callable[..., Tier], str]] = [
    ("hbm", _hbm, "lower hbm.capacity_bytes or pick another hbm.device"),
    ("dram", _dram, "lower dram.capacity_bytes (or enlarge /dev/shm)"),
    ("nvme", _nvme, "point nvme.path at a writable directory or lower nvme.map_size"),
]


def build_tiers(config: Config) -> list[Tier]:
    """The enabled tiers, fastest first; on failure none is left open."""
    tiers: list[Tier] = []
    try:
        for name, build, fix in _PLAN:
            section = getattr(config, name)
            if not section.enabled:
                continue
            try:
                tiers.append(build(section))
            except Exception as e:
                raise ConfigError(
                    f"cannot build the {name} tier: {e}; {fix}, or set {name}.enabled to false"
                ) from e
    except BaseException:
        _close(tiers)
        raise
    return tiers


def build_store(config: Config) -> TieredStore:
    """A ``TieredStore`` over ``build_tiers(config)``; rebuilds its index from nvme if enabled."""
    tiers = build_tiers(config)
    s = config.store
    try:
        return TieredStore(
            tiers,
            write_policy=s.write_policy,
            eviction_policy=s.eviction_policy,
            high_watermark=s.high_watermark,
            low_watermark=s.low_watermark,
            max_chunk_bytes=config.server.max_chunk_bytes,
        )
    except BaseException:
        _close(tiers)
        raise


def _close(tiers: list[Tier]) -> None:
    # A failing close must not hide the error that made us close.
    for tier in reversed(tiers):
        try:
            tier.close()
        except Exception:
            log.exception("closing the %s tier after a failed start", tier.name)
