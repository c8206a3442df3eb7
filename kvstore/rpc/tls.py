"""Transport security shared by the server and the clients: TLS credentials from PEM
files and bearer tokens. No store, no service: both sides import it.

Offers ``server_credentials(cert, key, client_ca)``, ``ClientAuth`` (CA, client
certificate and key, token; ``ClientAuth.from_env()`` reads ``KVSTORE_TLS_CA``,
``KVSTORE_TLS_CERT``, ``KVSTORE_TLS_KEY``, ``KVSTORE_TOKEN_FILE`` or
``KVSTORE_TOKEN``) and ``ClientAuth.channel(address, options)`` /
``aio_channel(...)``: a channel that is TLS when a CA is given and sends the
token as ``authorization: Bearer ...`` metadata on every call.

A token is read from a file or the environment, never taken as a command-line
argument (which every user of the host can read in the process list) and never
logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from kvstore.core.types import InvalidArgument

TOKEN_HEADER = "authorization"


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read the {what} at {path}: {e.strerror}") from e


def read_token(path: str) -> str:
    token = read_file(path, "token file").decode().strip()
    if not token or any(c.isspace() for c in token):
        raise InvalidArgument(f"the token file {path} must hold one token and nothing else")
    return token


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with this certificate; with ``client_ca``, clients must show a certificate it signed."""
    pair = (read_file(key, "TLS key"), read_file(cert, "TLS certificate"))
    ca = read_file(client_ca, "client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


@dataclass(frozen=True, slots=True)
class ClientAuth:
    ca: str = ""  # PEM of the CA that signed the server's certificate; empty: plaintext
    cert: str = ""  # client certificate and key, for a server that asks for them (mTLS)
    key: str = ""
    token: str = ""

    def __repr__(self) -> str:  # never print the token
        return (
            f"ClientAuth(ca={self.ca!r}, cert={self.cert!r}, token={'***' if self.token else ''!r})"
        )

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("a client certificate needs its key, and a key its certificate")
        if self.cert and not self.ca:
            raise InvalidArgument("a client certificate is only sent over TLS: give the CA too")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientAuth:
        env = os.environ if env is None else env
        token = env.get("KVSTORE_TOKEN", "")
        if env.get("KVSTORE_TOKEN_FILE"):
            token = read_token(env["KVSTORE_TOKEN_FILE"])
        return cls(
            ca=env.get("KVSTORE_TLS_CA", ""),
            cert=env.get("KVSTORE_TLS_CERT", ""),
            key=env.get("KVSTORE_TLS_KEY", ""),
            token=token,
        )

    def with_files(self, ca: str = "", cert: str = "", key: str = "", token_file: str = ""):
        """A copy with whichever of these paths are given (command-line flags) taking over."""
        return ClientAuth(
            ca=ca or self.ca,
            cert=cert or self.cert,
            key=key or self.key,
            token=read_token(token_file) if token_file else self.token,
        )

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca, "TLS CA"),
            private_key=read_file(self.key, "TLS key") if self.key else None,
            certificate_chain=read_file(self.cert, "TLS certificate") if self.cert else None,
        )

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: list) -> grpc.Channel:
        ch = (
            grpc.secure_channel(address, self._credentials(), options=options)
            if self.ca
            else grpc.insecure_channel(address, options=options)
        )
        metadata = self._metadata()
        return grpc.intercept_channel(ch, _TokenInterceptor(metadata)) if metadata else ch

    def aio_channel(self, address: str, options: list) -> grpc.aio.Channel:
        md = self._metadata()
        kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary)
        interceptors = [kind(md) for kind in kinds] if md else None
        if self.ca:
            return grpc.aio.secure_channel(
                address, self._credentials(), options=options, interceptors=interceptors
            )
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata) -> None:
        self._md = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, tuple(details.metadata or ()) + self._md), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_Details(details, tuple(details.metadata or ()) + self._md), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(
            _Details(details, tuple(details.metadata or ()) + self._md), request_iterator
        )

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(
            _Details(details, tuple(details.metadata or ()) + self._md), request_iterator
        )


class _AioToken:
    """Adds the token to a call's metadata. grpc.aio files an interceptor under one
    kind only, so each kind gets its own subclass below."""

    def __init__(self, metadata) -> None:
        self._md = metadata

    def _details(self, details):
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            tuple(details.metadata or ()) + self._md,
            details.credentials,
            details.wait_for_ready,
        )


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)
