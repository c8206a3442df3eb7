"""The pure core: chunk and key types, the chained key spec, payload framing, codecs, wire framing.

Shared by the server, the client and the connector. Never imports gRPC, storage libraries,
the server, the client or the connector (``make lint`` checks it).
"""
