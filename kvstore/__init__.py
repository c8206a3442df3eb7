"""kvstore: a tiered KV-cache block store for LLM serving.

Folders, imports pointing one way: ``core`` (pure: types, keys, payload, codec, wire) <-
``rpc`` (stubs, TLS) <- ``server`` (index, tiers, store, service, app) and ``client``
(gRPC clients, shared memory, shards) <- ``cli`` / ``server.py`` / ``connector``. The server
never imports the client, the client never imports the server, nothing here imports the
connector (``make lint`` checks all three).
"""

__version__ = "0.1.0"
