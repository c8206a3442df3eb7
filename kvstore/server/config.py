"""The server's configuration: frozen dataclasses that check themselves, and where values come from.

Offers ``Config`` (sections ``server``, ``store``, ``dram``, ``nvme``, ``hbm``; ``to_dict``),
``load_config`` (overrides > ``KVSTORE_<SECTION>_<KEY>`` environment > YAML file > embedded
defaults), ``parse_size``/``format_size`` ("2GiB", "1.5GB", "4096"), ``describe_options``
(one row per option, for the README and the CLI help) and ``ConfigError``.

Sections are pydantic dataclasses: pydantic coerces each field to its type (strings become
numbers, sizes, and booleans such as ``yes``/``off``), then the section runs its own checks, so
YAML, environment and command-line values all pass the same checks, and an error always names
the dotted key and, when loaded, where the value came from. Only ``load_config`` reads the
environment or a file: a ``Config`` built directly is its arguments over the defaults, never
what happens to be in ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Annotated, Any, NamedTuple

import pydantic
import yaml

from kvstore.core.types import InvalidArgument
from kvstore.server.index import POLICIES
from kvstore.server.store import WRITE_POLICIES
from kvstore.server.tiers.nvme_format import COMPRESSION

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENV_PREFIX = "KVSTORE_"
ENV_CONFIG = "KVSTORE_CONFIG"
# a client's TLS and token settings (kvstore.rpc.tls.ClientAuth.from_env), not the server's
CLIENT_ENV = frozenset(
    ("KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE")
)


class ConfigError(InvalidArgument):
    """A config value is unknown or invalid; ``key`` is its dotted name when there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# k, M, G... are powers of 1000 and Ki, Mi, Gi... powers of 1024, as in Kubernetes quantities.
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgtpe", start=1)
    for suffix, base in (("", 1000), ("b", 1000), ("i", 1024), ("ib", 1024))
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE)
_BINARY = ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB")


def _to_bytes(value: object) -> int:
    # Not pydantic's ByteSize: it reads "1,024" as 1 B, "0.3KiB" as 307 B and "1.5" as 1 B,
    # where a typo must be an error; this one is exact (Decimal) or refuses.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError("must be a size such as 2GiB, 512MiB, 1.5GB or 4096")
    n = Decimal(m.group(1)) * unit
    if n != n.to_integral_value():
        raise ValueError("must be a whole number of bytes")
    return int(n)


def parse_size(value: object, key: str = "size") -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "1.5GB", "64k" or "4096"."""
    try:
        return _to_bytes(value)
    except ValueError as e:
        raise ConfigError(f"{key} {e}, got {value!r}", key) from None


def format_size(n: int) -> str:
    """The shortest exact binary spelling: 2GiB, 4160KiB, 4096 -> 4KiB, 1000 -> 1000."""
    for i, unit in enumerate(_BINARY):
        scale = 1024 ** (len(_BINARY) - i)
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _strip(value: object) -> object:
    return value.strip() if isinstance(value, str) else value


# Field types beyond pydantic's own: a size in bytes, and a boolean that forgives " on ".
Size = Annotated[int, pydantic.BeforeValidator(_to_bytes)]
Bool = Annotated[bool, pydantic.BeforeValidator(_strip)]

# pydantic's error types, as the rule a value broke; a validator's own ValueError is its rule.
_RULES = {
    **dict.fromkeys(("bool_parsing", "bool_type"), "must be true/false, 1/0, yes/no or on/off"),
    **dict.fromkeys(("int_parsing", "int_from_float", "int_type"), "must be an integer"),
    **dict.fromkeys(("float_parsing", "float_type", "finite_number"), "must be a finite number"),
    "string_type": "must be a string",
}


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
    map_size: Size = _size(64 * GiB, "LMDB map size: the most bytes the tier holds")
    compression: str = _opt("zstd", "value compression: zstd | none")
    zstd_level: int = _opt(1, "zstd level, 1 (fast) to 22 (small)")
    sync: Bool = _opt(False, "fsync every commit (slower; survives power loss)")

    def _check(self) -> None:
        self._require(bool(self.path), "path", "must not be empty")
        self._require(self.map_size > 0, "map_size", "must be positive")
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


# The layering is written here rather than taken from pydantic-settings, whose sources each
# break a promise above (checked with pydantic-settings 2.16): the YAML source silently ignores
# a missing file, raises a bare ValueError on a file that is a list and refuses an empty
# section; the environment source drops variables of unknown sections (KVSTORE_CACHE_SIZE) and
# reads only os.environ; the CLI source refuses a bare --hbm.enabled and adds a --SECTION JSON
# flag per section; sources chosen per call need BaseSettings(_build_sources=...), a private
# argument whose shape is changing; and none says which source a bad value came from. Each
# workaround costs more than the code below, and the import costs another 45-90 ms per start.
def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Overrides (dotted keys) > ``KVSTORE_<SECTION>_<KEY>`` > YAML file > defaults.

    ``env`` defaults to ``os.environ``; with no ``path``, ``KVSTORE_CONFIG`` names the file.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, object]] = {s: {} for s in _SECTIONS}
    origin: dict[str, str] = {}

    def put(section: str, name: str, value: object, source: str) -> None:
        _check_known(section, name, source)
        values[section][name] = value
        origin[f"{section}.{name}"] = source

    path = path or env.get(ENV_CONFIG) or None
    if path:
        for section, items in _read_yaml(path).items():
            for name, value in items.items():
                put(section, str(name), value, path)
    for var, value in sorted(env.items()):
        if var.startswith(ENV_PREFIX) and var != ENV_CONFIG and var not in CLIENT_ENV:
            section, _, name = var[len(ENV_PREFIX) :].lower().partition("_")
            put(section, name, value, f"environment variable {var}")
    for dotted, value in (overrides or {}).items():
        section, _, name = dotted.partition(".")
        put(section, name, value, "overrides")

    sections = {}
    for section, cls in _SECTIONS.items():
        try:
            sections[section] = _build(cls, values[section])
        except ConfigError as e:
            if e.key not in origin:
                raise
            raise ConfigError(f"{e} (from {origin[e.key]})", e.key) from None
    return Config(**sections)  # type: ignore[arg-type]


def _build(cls: type[_Section], values: Mapping[str, object]) -> _Section:
    """The section from raw values; pydantic's first complaint becomes a ``ConfigError``."""
    try:
        return cls(**values)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = f"{cls.SECTION}.{err['loc'][0]}"
        rule = (
            str(err["ctx"]["error"])
            if err["type"] == "value_error"
            else _RULES.get(err["type"], err["msg"])
        )
        raise ConfigError(f"{key} {rule}, got {err['input']!r}", key) from None


def _check_known(section: str, name: str, source: str) -> None:
    if section not in _SECTIONS:
        raise ConfigError(
            f"unknown config section {section!r} (from {source}); "
            f"valid sections: {', '.join(_SECTIONS)}"
        )
    valid = [f.name for f in dataclasses.fields(_SECTIONS[section])]  # type: ignore[arg-type]
    if name not in valid:
        key = f"{section}.{name}"
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"; did you mean {section}.{close[0]}?" if close else ""
        raise ConfigError(
            f"unknown config key {key!r} (from {source}); "
            f"valid keys of {section}: {', '.join(valid)}{hint}",
            key,
        )


def _read_yaml(path: str) -> dict[str, dict[str, object]]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    sections = {} if doc is None else doc
    if not isinstance(sections, dict) or not all(
        items is None or isinstance(items, dict) for items in sections.values()
    ):
        raise ConfigError(f"config file {path} must map sections to mappings of keys, got {doc!r}")
    return {str(section): items or {} for section, items in sections.items()}
