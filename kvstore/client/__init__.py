"""The client side: gRPC clients (``grpc_client``), where their puts go (``put_routes``),
same-host shared-memory reads and writes (``shm_reader``, ``shm_writer``) and sharding over
several stores (``shards``).

What vLLM processes load: never imports server code (``make lint`` checks it).
"""

from kvstore.client.grpc_client import (
    AsyncKVStoreClient,
    ClientError,
    ClientOptions,
    KVStoreClient,
)

__all__ = ["AsyncKVStoreClient", "ClientError", "ClientOptions", "KVStoreClient"]
