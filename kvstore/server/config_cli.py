"""Command-line flags for every config option, generated from ``kvstore.server.config``.

Offers ``add_cli_flags(parser)``: ``--config PATH`` plus one ``--section.key`` flag per
option (``--dram.capacity-bytes 1GiB``, ``--nvme.enabled false``; a bare boolean flag means
true), and ``overrides_from_args(args)``: the dotted overrides that were set, for
``load_config(args.config, overrides=...)``. Every flag defaults to None so that an unset flag
never hides the YAML file or the environment; values stay strings here and ``load_config``
coerces and checks them like environment values.
"""

from __future__ import annotations

import argparse

from kvstore.server.config import ENV_CONFIG, ENV_PREFIX, describe_options

_METAVAR = {"size": "SIZE", "int": "N", "float": "NUM", "bool": "BOOL", "str": "STR"}


def _dest(key: str) -> str:
    # A prefix keeps the generated names apart from the parser's other arguments.
    return "config__" + key.replace(".", "__")


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one ``--section.key`` flag per option, grouped by section."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"YAML config file (default: ${ENV_CONFIG}, else the built-in defaults)",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in describe_options():
        section, _, name = opt.key.partition(".")
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} options")
        env = f"{ENV_PREFIX}{section}_{name}".upper()
        groups[section].add_argument(
            f"--{section}.{name.replace('_', '-')}",
            dest=_dest(opt.key),
            default=None,
            metavar=_METAVAR[opt.type],
            help=f"{opt.help} (default: {opt.default}; env {env})".replace("%", "%%"),
            **({"nargs": "?", "const": "true"} if opt.type == "bool" else {}),
        )


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The dotted keys whose flags were given, with their values, for ``load_config``."""
    given = {opt.key: getattr(args, _dest(opt.key), None) for opt in describe_options()}
    return {key: value for key, value in given.items() if value is not None}
