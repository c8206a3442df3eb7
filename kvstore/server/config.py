"""The server's configuration: frozen dataclasses that check themselves, and where values come from.

Offers ``Config`` (sections ``server``, ``store``, ``dram``, ``nvme``, ``hbm``; ``to_dict``),
``load_config`` (overrides > ``KVSTORE_<SECTION>_<KEY>`` environment > YAML file > embedded
defaults), ``parse_size``/``format_size`` ("2GiB", "1.5GB", "4096"), ``describe_options``
(one row per option, for the README and the CLI help) and ``ConfigError``. The value types
and sizes live in ``config_types``, the sources and their layering in ``config_sources``;
both are re-exported here.

Sections are pydantic dataclasses: pydantic coerces each field to its type (strings become
numbers, sizes, and booleans such as ``yes``/``off``), then the section runs its own checks, so
YAML, environment and command-line values all pass the same checks, and an error always names
the dotted key and, when loaded, where the value came from. Only ``load_config`` reads the
environment or a file: a ``Config`` built directly is its arguments over the defaults, never
what happens to be in ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pydantic

from kvstore.server.config_sources import CLIENT_ENV, ENV_CONFIG, ENV_PREFIX, layered
from kvstore.server.config_types import (
    Bool,
    ConfigError,
    GiB,
    KiB,
    MiB,
    Size,
    format_size,
    parse_size,
)
from kvstore.server.index import POLICIES
from kvstore.server.store import WRITE_POLICIES
from kvstore.server.tiers.nvme_format import COMPRESSION

__all__ = [
    "CLIENT_ENV",
    "ENV_CONFIG",
    "ENV_PREFIX",
    "GiB",
    "KiB",
    "MiB",
    "Config",
    "ConfigError",
    "DramConfig",
    "HbmConfig",
    "NvmeConfig",
    "Option",
    "ServerConfig",
    "StoreConfig",
    "describe_options",
    "format_size",
    "load_config",
    "parse_size",
]


def _opt(default: object, help: str, kind: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "kind": kind or type(default).__name__})


def _size(default: int, help: str) -> Any:
    return _opt(default, help, "size")


# Every section: frozen and slotted; pydantic has coerced every field before __post_init__.
_section = pydantic.dataclasses.dataclass(
    frozen=True, slots=True, config=pydantic.ConfigDict(allow_inf_nan=False)
)


class _Section:
    """Runs the section's own checks (``_check``) once pydantic has given every field its type."""

    __slots__ = ()
    SECTION = ""

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """Range and cross-field checks, run once every field has its type."""

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"

    def _require(self, ok: bool, name: str, rule: str) -> None:
        if not ok:
            key = self._key(name)
            raise ConfigError(f"{key} {rule}, got {getattr(self, name)!r}", key)

    def _one_of(self, name: str, choices: list[str] | tuple[str, ...]) -> None:
        self._require(getattr(self, name) in choices, name, f"must be one of {', '.join(choices)}")


_MIN_REGION = 64 * KiB
_SLOT_BYTES_HELP = "deprecated and ignored: chunks of any size share the region"


def _check_region(tier: DramConfig | HbmConfig) -> None:
    tier._require(
        tier.capacity_bytes >= _MIN_REGION, "capacity_bytes", f"must be at least {_MIN_REGION} B"
    )
    tier._require(tier.slot_bytes >= 0, "slot_bytes", "must not be negative")


def _is_address(addr: str, unix: bool) -> bool:
    if unix and addr.startswith("unix:"):
        return len(addr) > len("unix:")
    host, _, port = addr.rpartition(":")
    return bool(host) and re.fullmatch(r"[0-9]{1,5}", port) is not None and int(port) <= 65535


@_section
class ServerConfig(_Section):
    SECTION = "server"
    listen: str = _opt("127.0.0.1:50051", "gRPC listen address: host:port or unix:PATH")
    metrics_listen: str = _opt("127.0.0.1:9400", "Prometheus /metrics host:port; empty disables")
    max_message_bytes: Size = _size(65 * MiB, "largest gRPC message; must exceed max_chunk_bytes")
    max_keys_per_request: int = _opt(65536, "most keys one request may name")
    max_chunk_bytes: Size = _size(64 * MiB, "largest chunk payload a Put may store")
    shm: Bool = _opt(True, "offer same-host clients shared-memory handles")
    grace_s: float = _opt(10.0, "seconds in-flight calls get to finish at shutdown")
    workers: int = _opt(16, "gRPC server thread pool size")
    tls_cert: str = _opt("", "PEM certificate for TLS on the gRPC port; empty: plaintext")
    tls_key: str = _opt("", "PEM private key of tls_cert")
    tls_client_ca: str = _opt("", "with TLS, require client certificates this CA signed (mTLS)")
    tenants_file: str = _opt("", "YAML file of tenants and their tokens; empty: no auth")
    max_leases_per_client: int = _opt(4096, "unexpired leases one client may hold")
    max_streams_per_client: int = _opt(64, "Get/Put streams one client may have open")
    max_inflight_bytes_per_client: Size = _size(GiB, "Put bytes one client may have in flight")
    put_process: Bool = _opt(
        True, "serve Put from a process of its own, so puts never slow lookups (needs dram)"
    )
    put_listen: str = _opt(
        "", "host:port of the put process; empty: listen's host, a free port (told to clients)"
    )
    local_channel: Bool = _opt(
        True,
        "with shm, answer same-host clients on a Unix socket too, not only gRPC (not with mTLS)",
    )

    def _check(self) -> None:
        self._require(
            bool(self.tls_cert) == bool(self.tls_key), "tls_key", "must be set with tls_cert"
        )
        self._require(
            not self.tls_client_ca or bool(self.tls_cert),
            "tls_client_ca",
            "needs TLS: set tls_cert and tls_key too",
        )
        for name in ("max_leases_per_client", "max_streams_per_client"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(
            self.max_inflight_bytes_per_client > 0,
            "max_inflight_bytes_per_client",
            "must be positive",
        )
        self._require(
            _is_address(self.listen, unix=True), "listen", "must be host:port or unix:PATH"
        )
        self._require(
            not self.put_listen or _is_address(self.put_listen, unix=False),
            "put_listen",
            "must be host:port, or empty for listen's host and a free port",
        )
        self._require(
            not self.metrics_listen or _is_address(self.metrics_listen, unix=False),
            "metrics_listen",
            "must be host:port, or empty to disable metrics",
        )
        self._require(self.max_chunk_bytes > 0, "max_chunk_bytes", "must be positive")
        self._require(
            self.max_message_bytes > self.max_chunk_bytes,
            "max_message_bytes",
            f"must exceed server.max_chunk_bytes ({self.max_chunk_bytes} B)",
        )
        self._require(self.max_keys_per_request > 0, "max_keys_per_request", "must be positive")
        self._require(self.grace_s >= 0, "grace_s", "must not be negative")
        self._require(self.workers > 0, "workers", "must be positive")


@_section
class StoreConfig(_Section):
    SECTION = "store"
    write_policy: str = _opt(
        "write_through", "when bytes reach nvme: " + " | ".join(WRITE_POLICIES)
    )
    eviction_policy: str = _opt("lru", "which chunks leave a full tier first: lru | fifo")
    high_watermark: float = _opt(0.95, "tier occupancy that starts eviction")
    low_watermark: float = _opt(0.85, "tier occupancy eviction brings a tier down to")
    lease_ttl_s: float = _opt(30.0, "lease length when a client asks for one without a ttl")
    max_lease_ttl_s: float = _opt(600.0, "longest lease a client may ask for")

    def _check(self) -> None:
        self._one_of("write_policy", WRITE_POLICIES)
        self._one_of("eviction_policy", sorted(POLICIES))
        self._require(0 < self.high_watermark <= 1, "high_watermark", "must be in (0, 1]")
        self._require(
            0 < self.low_watermark <= self.high_watermark,
            "low_watermark",
            f"must be in (0, store.high_watermark={self.high_watermark}]",
        )
        self._require(self.lease_ttl_s > 0, "lease_ttl_s", "must be positive")
        self._require(
            self.max_lease_ttl_s >= self.lease_ttl_s,
            "max_lease_ttl_s",
            f"must be at least store.lease_ttl_s ({self.lease_ttl_s})",
        )


@_section
class DramConfig(_Section):
    SECTION = "dram"
    enabled: Bool = _opt(True, "keep chunks in a host shared-memory region (/dev/shm)")
    capacity_bytes: Size = _size(2 * GiB, "size of the region")
    slot_bytes: Size = _size(0, _SLOT_BYTES_HELP)

    def _check(self) -> None:
        _check_region(self)


@_section
class NvmeConfig(_Section):
    SECTION = "nvme"
    enabled: Bool = _opt(True, "persist chunks in LMDB; the index is rebuilt from it at start")
    path: str = _opt("./data/lmdb", "LMDB directory, created with its parents")
    map_size: Size = _size(
        0,
        "LMDB map size: the most bytes the tier holds; 0 = fit the disk: 64GiB, or 90% of "
        "the free space (plus what the tier holds already) where that is less",
    )
    compression: str = _opt("zstd", "value compression: zstd | none")
    zstd_level: int = _opt(1, "zstd level, 1 (fast) to 22 (small)")
    sync: Bool = _opt(False, "fsync every commit (slower; survives power loss)")

    def _check(self) -> None:
        self._require(bool(self.path), "path", "must not be empty")
        self._require(self.map_size >= 0, "map_size", "must be 0 (fit the disk) or positive")
        self._one_of("compression", sorted(COMPRESSION, reverse=True))
        self._require(1 <= self.zstd_level <= 22, "zstd_level", "must be in 1..22")


@_section
class HbmConfig(_Section):
    SECTION = "hbm"
    enabled: Bool = _opt(False, "keep chunks in GPU memory (needs CuPy and a CUDA device)")
    capacity_bytes: Size = _size(8 * GiB, "size of the device allocation")
    slot_bytes: Size = _size(0, _SLOT_BYTES_HELP)
    device: int = _opt(0, "CUDA device ordinal")

    def _check(self) -> None:
        _check_region(self)
        self._require(self.device >= 0, "device", "must not be negative")


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)

    def __post_init__(self) -> None:
        if not (self.hbm.enabled or self.dram.enabled or self.nvme.enabled):
            raise ConfigError(
                "no tier is enabled: set at least one of hbm.enabled, dram.enabled, nvme.enabled"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, loadable back as a YAML config file."""
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type[_Section]] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(Config)
}


class Option(NamedTuple):
    key: str
    type: str
    default: str
    help: str


def _show(f: dataclasses.Field) -> str:
    if f.metadata["kind"] == "size":
        return format_size(f.default)  # type: ignore[arg-type]
    if f.metadata["kind"] == "bool":
        return str(f.default).lower()
    return str(f.default) if f.default != "" else '""'


def describe_options() -> list[Option]:
    """(dotted key, type, default as written in YAML, help) for every option, in order."""
    return [
        Option(f"{s}.{f.name}", f.metadata["kind"], _show(f), f.metadata["help"])
        for s, cls in _SECTIONS.items()
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    ]


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Overrides (dotted keys) > ``KVSTORE_<SECTION>_<KEY>`` > YAML file > defaults.

    ``env`` defaults to ``os.environ``; with no ``path``, ``KVSTORE_CONFIG`` names the file.
    """
    return Config(**layered(_SECTIONS, path, env, overrides))  # type: ignore[arg-type]
