"""The config's value types: byte sizes, forgiving booleans, and the error that names a key.

Offers ``ConfigError``, ``parse_size``/``format_size`` ("2GiB", "1.5GB", "4096"), the
field types ``Size`` and ``Bool`` the config sections declare, and ``KiB``/``MiB``/``GiB``.
A size is exact or refused: it never rounds, and never reads a typo as a smaller number.
It reads no file and no environment.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated

import pydantic

from kvstore.core.types import InvalidArgument

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


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
