"""What makes a request's KV its own beyond its token ids, and the chunk keys that follow.

Offers ``request_identity(request)`` (LoRA adapter and cache salt, the fields
that start a request's chain at its own root), ``mm_extras(request, ...)`` (per
chunk: the multimodal inputs behind its placeholder tokens), ``unkeyable(request)``
(why a request cannot be keyed at all) and ``RequestChain`` (one request's chunk
keys, grown as its tokens grow: prompt first, then generated tokens).

Two requests share chunks exactly when vLLM's own prefix cache would let them
share blocks: same tokens, same adapter, same cache salt, same multimodal inputs
at the same places. A LoRA adapter is known by its name, which must name the
same weights on every node that shares a store (as the model name must). Never uses
Python's ``hash`` or vLLM's block hashes: every process and engine version must agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvstore.core.keys import chunk_keys, request_root


def request_identity(request) -> dict[str, str]:
    lora = getattr(request, "lora_request", None)
    return {
        "lora": (lora.lora_name or "") if lora is not None else "",
        "cache_salt": getattr(request, "cache_salt", None) or "",
    }


def unkeyable(request) -> str | None:
    """Why a request's KV cannot be named by token ids, or None when it can."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings instead of token ids"
    return None


def mm_extras(request, chunk_tokens: int, first: int, count: int) -> list[bytes | None] | None:
    """For chunks ``first .. first+count-1``: the multimodal inputs each one holds.

    Like vLLM's block hashes: each input overlapping the chunk, by its content
    hash and its offset from the chunk's start. None when the request has none.
    """
    features = getattr(request, "mm_features", None) or []
    if not features:
        return None
    extras: list[bytes | None] = []
    for c in range(first, first + count):
        start, end = c * chunk_tokens, (c + 1) * chunk_tokens
        inside = [
            [f.identifier, f.mm_position.offset - start]
            for f in features
            if f.mm_position.offset < end and f.mm_position.offset + f.mm_position.length > start
        ]
        extras.append(json.dumps(inside, separators=(",", ":")).encode() if inside else None)
    return extras


def _tokens(request) -> Sequence[int]:
    tokens = getattr(request, "all_token_ids", None)
    return tokens if tokens is not None else (request.prompt_token_ids or [])


class RequestChain:
    """The chunk keys of one request; ``extend(n)`` keys the full chunks of its first n tokens."""

    def __init__(self, ns_digest: bytes, request, chunk_tokens: int) -> None:
        self.request = request
        self.chunk_tokens = chunk_tokens
        self.root = request_root(ns_digest, request_identity(request))
        self.keys: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(_tokens(self.request))

    def extend(self, num_tokens: int) -> list[bytes]:
        num_tokens = min(num_tokens, self.num_tokens)
        have, want = len(self.keys), num_tokens // self.chunk_tokens
        if want > have:
            c = self.chunk_tokens
            tokens = list(_tokens(self.request)[have * c : want * c])
            extras = mm_extras(self.request, c, have, want - have)
            parent = self.keys[-1] if self.keys else None
            self.keys += chunk_keys(self.root, tokens, c, parent=parent, extras=extras)
        return self.keys
