"""The generated protobuf and gRPC modules, with a clear error when they are missing.

The stubs are generated from ``proto/kvstore/v1/kvstore.proto`` (``make proto``), never
edited by hand.
"""

from __future__ import annotations

try:
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
except ImportError as exc:  # pragma: no cover - only on an install that skipped `make proto`
    raise ImportError(
        "kvstore's gRPC stubs are missing: run `make proto` (or `make install`) to generate "
        "kvstore/v1/kvstore_pb2.py from proto/kvstore/v1/kvstore.proto"
    ) from exc

SERVICE = "kvstore.v1.KVStore"

__all__ = ["SERVICE", "pb", "pb_grpc"]
