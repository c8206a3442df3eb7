"""Why a key chain is not (fully) stored: ``explain(store, keys, namespace, lease_id)``.

Read-only: it never refreshes recency, takes a lease or reads a tier, so asking why a
chain missed never changes what the next lookup finds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.server.store import TieredStore


@dataclass(frozen=True, slots=True)
class Explanation:
    matched: int
    reason: str
    detail: str
    tier: str | None = None
    seconds_ago: float | None = None
    tiers: list[str] = field(default_factory=list)


def explain(
    store: TieredStore,
    keys: Sequence[bytes],
    namespace: bytes | None = None,
    lease_id: int | None = None,
    owner: bytes | None = None,
) -> Explanation:
    if not keys:
        return Explanation(0, "empty", "no keys given")
    tiers, gone = store.peek(keys, owner)
    matched = len(tiers)
    lease_note = ""
    if lease_id and store.lease_expired(lease_id):
        lease_note = f" Lease {lease_id} expired, so the chain was no longer protected."
    if matched == len(keys):
        where = ", ".join(f"{n}×{t}" for t, n in _counts(tiers).items())
        return Explanation(
            matched, "complete", f"all {matched} chunks are stored ({where}).", tiers=tiers
        )
    missing = keys[matched].hex()
    if gone is not None:
        tier, when, why = gone
        ago = max(0.0, time.monotonic() - when)
        reason = {"evicted": "evicted", "demoted": "evicted"}.get(why, why)
        if why.startswith("corrupt"):
            reason = "corrupt"
        elif why in ("deleted", "namespace deleted"):
            reason = "deleted"
        detail = (
            f"chunk {matched} ({missing}) left tier {tier} {ago:.1f}s ago: {why}."
            if reason == "evicted"
            else f"chunk {matched} ({missing}) was removed {ago:.1f}s ago: {why}."
        )
        return Explanation(matched, reason, detail + lease_note, tier, ago, tiers)
    if matched == 0 and namespace is not None and namespace not in _namespaces(store):
        return Explanation(
            0,
            "namespace_unknown",
            f"no chunk of namespace {namespace.hex()} is stored: check the model, codec, "
            "chunk size and salt that make up the namespace." + lease_note,
        )
    return Explanation(
        matched,
        "never_stored",
        f"chunk {matched} ({missing}) was never stored here (or left too long ago to be "
        "remembered)." + lease_note,
        tiers=tiers,
    )


def _counts(tiers: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        out[t] = out.get(t, 0) + 1
    return out


def _namespaces(store: TieredStore) -> set[bytes]:
    return {bytes.fromhex(ns) for ns in store.stats().namespaces}
