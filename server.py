"""kvstore server: config -> tiers -> store -> gRPC + /metrics.

    python server.py [--config kvstore.yaml] [--dram.capacity-bytes 4GiB] ...

The same as ``kvstore serve``. Configuration comes from flags, then
``KVSTORE_<SECTION>_<KEY>`` environment variables, then the YAML file, then the
embedded defaults (DRAM + LMDB under ./data, gRPC on 127.0.0.1:50051, metrics
on 127.0.0.1:9400). SIGTERM or SIGINT stops it gracefully: new calls are
refused, in-flight ones finish, write-behind is flushed and LMDB is closed.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvstore.core.types import KVStoreError
from kvstore.server.app import serve
from kvstore.server.config import load_config
from kvstore.server.config_cli import add_cli_flags, overrides_from_args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_flags(parser)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config, overrides=overrides_from_args(args))
        return serve(config)
    except (KVStoreError, OSError) as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
