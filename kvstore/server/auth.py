"""Tenants and what each may reach. Server side; no I/O but reading the tenants file.

Offers ``Tenants.load(path)`` (a YAML file naming tenants and their tokens),
``Tenants.authenticate(metadata)`` -> ``Caller``, and the namespace tagging that
keeps tenants apart: ``tag_namespace(caller, ns)`` / ``shown_namespace(caller, ns)``.

Isolation: every namespace a tenant stores lives under an internal digest made
of an 8-byte tag derived from the tenant's name and the first 24 bytes of the
digest the client sent. The store checks the tag on every chain it matches, so a
tenant never reaches another's chunks: guessed keys read as misses, a put under
another tenant's parent is refused as "parent is not stored", and a delete by
namespace only ever names the caller's own. An ``admin`` tenant also sees the
whole store in ``Stats``. Tokens are kept as SHA-256 digests and compared in
constant time; neither tokens nor digests ever reach a log or /metrics.

The tenants file::

    tenants:
      - name: team-a
        tokens: [<token>, ...]        # or token_sha256: [<hex>, ...]
      - name: ops
        admin: true
        token_sha256: [<hex>]
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from kvstore.core.types import KVStoreError, check_ns

TAG_BYTES = 8


class Unauthenticated(KVStoreError):
    """No token, or one no tenant holds."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call: a tenant (with its namespace tag), or anyone when auth is off."""

    client: str  # the key for per-client limits: the tenant name, or the peer address
    tenant: str | None = None
    tag: bytes | None = None
    admin: bool = False


def tenant_tag(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=TAG_BYTES, person=b"kvstore-ten").digest()


def tag_namespace(caller: Caller, ns: bytes) -> bytes:
    """The internal digest of a namespace the caller names (itself when auth is off)."""
    ns = check_ns(ns)
    return ns if caller.tag is None else caller.tag + ns[: len(ns) - TAG_BYTES]


def owns(caller: Caller, internal_ns: bytes) -> bool:
    return caller.tag is None or internal_ns[:TAG_BYTES] == caller.tag


def shown_namespace(caller: Caller, internal_hex: str) -> str:
    """How a namespace is shown to the caller: without the tenant tag."""
    return internal_hex if caller.tag is None else internal_hex[2 * TAG_BYTES :]


class Tenants:
    def __init__(self, entries: Sequence[tuple[str, Sequence[bytes], bool]]) -> None:
        self._by_digest: dict[bytes, Caller] = {}
        for name, digests, admin in entries:
            caller = Caller(client=f"tenant:{name}", tenant=name, tag=tenant_tag(name), admin=admin)
            for digest in digests:
                if digest in self._by_digest:
                    raise KVStoreError("tenants file: the same token is given to two tenants")
                self._by_digest[digest] = caller

    @classmethod
    def load(cls, path: str) -> Tenants:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise KVStoreError(f"cannot read the tenants file {path}: {e}") from e
        entries = []
        for i, t in enumerate(doc.get("tenants") or []):
            where = f"tenants file {path}: tenants[{i}]"
            name = t.get("name") if isinstance(t, dict) else None
            if not isinstance(name, str) or not name:
                raise KVStoreError(f"{where} needs a name")
            digests = [hashlib.sha256(str(tok).encode()).digest() for tok in t.get("tokens") or []]
            try:
                digests += [bytes.fromhex(h) for h in t.get("token_sha256") or []]
            except ValueError as e:
                raise KVStoreError(f"{where}: token_sha256 must be hex digests") from e
            if not digests or any(len(d) != 32 for d in digests):
                raise KVStoreError(f"{where} ({name}) needs tokens or 32-byte token_sha256")
            entries.append((name, digests, bool(t.get("admin", False))))
        if not entries:
            raise KVStoreError(f"tenants file {path} names no tenant")
        return cls(entries)

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]]) -> Caller:
        token = None
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                token = value[len("Bearer ") :]
        if not token:
            raise Unauthenticated("this store needs a bearer token (KVSTORE_TOKEN_FILE)")
        digest = hashlib.sha256(token.encode()).digest()
        for known, caller in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return caller
        raise Unauthenticated("the bearer token is not valid for this store")
