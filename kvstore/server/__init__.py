"""The store process: radix index (``index``), tiers behind one interface (``tiers``), the
tiered store and its data movement (``store``, ``reads``, ``mover``, ``shm_puts``), the gRPC
service at the edge (``service``, ``grpc_server``), and configuration, wiring, metrics and
multi-tenancy (``config``, ``factory``, ``app``, ``metrics``, ``auth``, ``quotas``).

Never imports the client or the connector (``make lint`` checks it).
"""
