"""Disaggregated prefill/decode: what a prefill node's finished request tells the decode
node, and how the decode node checks it. Pure: no I/O.

A P/D proxy (vllm-router's ``--vllm-pd-disaggregation``, or any proxy speaking the same
protocol) sends the prompt to a prefill server with ``kv_transfer_params``
``{"do_remote_decode": true}`` and ``max_tokens`` 1, then to a decode server with the
``kv_transfer_params`` the prefill server's response carried. The prefill server's
connector answers ``{"kvstore": {"v": 1, "ns": ..., "chunks": n, "last": ...}}``: the
engine namespace, how many full prompt chunks it saved (or found stored) and the key of
the last one. The decode server's connector waits (bounded) until the store holds those
``n`` chunks, then loads them.

Offers ``wants_handoff(params)``, ``is_handoff(params)``, ``handoff_params(ns, keys, n)``
and ``expected_chunks(params, ns, keys)``. Never
uses vLLM's own keys (``do_remote_prefill`` would make vLLM report the prefill server's
cached-token count as the decode server's), and never raises on params another
connector wrote: they simply name nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

KEY = "kvstore"
VERSION = 1


def wants_handoff(params: Mapping | None) -> bool:
    """Whether a request was sent by a P/D proxy as the prefill leg."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def is_handoff(params: Mapping | None) -> bool:
    """Whether a request is the decode leg of a P/D proxy: its params carry a handoff
    (readable or not: ``expected_chunks`` says which)."""
    return isinstance(params, Mapping) and isinstance(params.get(KEY), Mapping)


def handoff_params(ns: bytes, keys: Sequence[bytes], n: int) -> dict | None:
    """The ``kv_transfer_params`` a prefill node returns for ``n`` saved prompt chunks."""
    if n <= 0 or n > len(keys):
        return None
    return {KEY: {"v": VERSION, "ns": ns.hex(), "chunks": n, "last": keys[n - 1].hex()}}


def expected_chunks(params: Mapping | None, ns: bytes, keys: Sequence[bytes]) -> tuple[int, str]:
    """How many leading chunks of ``keys`` a prefill node said it saved, and if none, why.

    ``keys`` are this node's own keys for the prompt; the handoff counts only when it
    came from an engine with the same namespace (model, chunk size, codec) and names
    the same chain (its last chunk's key is this prompt's key at that place).
    """
    if not is_handoff(params):
        return 0, ""
    mine = params[KEY]
    n = mine.get("chunks")
    if mine.get("v") != VERSION or not isinstance(n, int) or n <= 0:
        return 0, f"unreadable kvstore handoff {dict(mine)!r}"
    if mine.get("ns") != ns.hex():
        return 0, "handoff from an engine with another namespace (model, chunk size or codec)"
    if n > len(keys) or mine.get("last") != keys[n - 1].hex():
        return 0, "handoff names another prompt's chunks"
    return n, ""
