"""What both ends of the gRPC link share: the generated stubs (``pb``) and TLS/token plumbing
(``tls``). Never imports the server or the client (``make lint`` checks it).
"""
