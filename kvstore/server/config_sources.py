"""Where config values come from: overrides > ``KVSTORE_<SECTION>_<KEY>`` > YAML file.

Offers ``layered(sections, path, env, overrides)``, the config's sections built from
those sources over their defaults, and the names ``ENV_PREFIX``, ``ENV_CONFIG`` and
``CLIENT_ENV``. An unknown section or key is an error that lists the valid ones, and a
bad value's error names its dotted key and the source it came from. It never reads
``os.environ`` unless the caller passes no ``env``, and never guesses a missing file.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping

import pydantic
import yaml

from kvstore.server.config_types import ConfigError

ENV_PREFIX = "KVSTORE_"
ENV_CONFIG = "KVSTORE_CONFIG"
# a client's TLS and token settings (kvstore.rpc.tls.ClientAuth.from_env), not the server's
CLIENT_ENV = frozenset(
    ("KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE")
)

# pydantic's error types, as the rule a value broke; a validator's own ValueError is its rule.
_RULES = {
    **dict.fromkeys(("bool_parsing", "bool_type"), "must be true/false, 1/0, yes/no or on/off"),
    **dict.fromkeys(("int_parsing", "int_from_float", "int_type"), "must be an integer"),
    **dict.fromkeys(("float_parsing", "float_type", "finite_number"), "must be a finite number"),
    "string_type": "must be a string",
}


# The layering is written here rather than taken from pydantic-settings, whose sources each
# break a promise above (checked with pydantic-settings 2.16): the YAML source silently ignores
# a missing file, raises a bare ValueError on a file that is a list and refuses an empty
# section; the environment source drops variables of unknown sections (KVSTORE_CACHE_SIZE) and
# reads only os.environ; the CLI source refuses a bare --hbm.enabled and adds a --SECTION JSON
# flag per section; sources chosen per call need BaseSettings(_build_sources=...), a private
# argument whose shape is changing; and none says which source a bad value came from. Each
# workaround costs more than the code below, and the import costs another 45-90 ms per start.
def layered(
    sections: Mapping[str, type],
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """``{section: instance}`` of ``sections`` (pydantic dataclasses) from every source.

    ``env`` defaults to ``os.environ``; with no ``path``, ``KVSTORE_CONFIG`` names the file.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, object]] = {s: {} for s in sections}
    origin: dict[str, str] = {}

    def put(section: str, name: str, value: object, source: str) -> None:
        _check_known(sections, section, name, source)
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

    built = {}
    for section, cls in sections.items():
        try:
            built[section] = _build(section, cls, values[section])
        except ConfigError as e:
            if e.key not in origin:
                raise
            raise ConfigError(f"{e} (from {origin[e.key]})", e.key) from None
    return built


def _build(section: str, cls: type, values: Mapping[str, object]) -> object:
    """The section from raw values; pydantic's first complaint becomes a ``ConfigError``."""
    try:
        return cls(**values)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = f"{section}.{err['loc'][0]}"
        rule = (
            str(err["ctx"]["error"])
            if err["type"] == "value_error"
            else _RULES.get(err["type"], err["msg"])
        )
        raise ConfigError(f"{key} {rule}, got {err['input']!r}", key) from None


def _check_known(sections: Mapping[str, type], section: str, name: str, source: str) -> None:
    if section not in sections:
        raise ConfigError(
            f"unknown config section {section!r} (from {source}); "
            f"valid sections: {', '.join(sections)}"
        )
    valid = [f.name for f in dataclasses.fields(sections[section])]  # type: ignore[arg-type]
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
