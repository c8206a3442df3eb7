"""The connector's settings, read from ``kv_connector_extra_config`` and checked at start.

Offers ``ConnectorConfig.from_extra(extra, block_size)``: unknown keys and bad
values raise ``ConnectorConfigError`` naming the key, so a misconfigured
engine refuses to start instead of silently running without the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvstore.core.keys import CODECS


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` key is unknown or has a bad value."""


def _coerce(key: str, value: object, want: type) -> object:
    if want is bool:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        pass
    elif want is float and isinstance(value, (int, float)):
        return float(value)
    elif isinstance(value, want):
        return value
    raise ConnectorConfigError(
        f"kv_connector_extra_config.{key} must be {want.__name__}, got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    store: str = "127.0.0.1:50051"
    chunk_tokens: int = 0  # 0: one chunk per engine block
    codec: str = "fp8"
    namespace_salt: str | None = None
    lookup_timeout_s: float = 0.5
    load_timeout_s: float = 5.0
    save_timeout_s: float = 10.0
    # steps whose chunks wait to be sent; a chunked prefill saves a chunk or so a step, so
    # this must outlast a long prompt under load (save_queue_bytes bounds the memory)
    save_queue_depth: int = 64
    save_queue_bytes: int = 1 << 30  # KV copied out of the engine and not yet sent
    save_generated: bool = True  # full chunks of generated tokens too (multi-turn reuse)
    lease_ttl_s: float = 30.0
    # "shm": copy chunks through the store's shared memory (same host only), "tcp": gRPC,
    # "auto": shm when ``store`` is a unix socket or a loopback address
    transport: str = "auto"
    # with shm: lookups and same-host put calls over the store's Unix socket when it offers
    # one (kvstore.client.local_calls; 0.4-1 ms less a call than gRPC); off: gRPC only,
    # e.g. through a proxy on this host, which the socket would go around
    local_calls: bool = True
    compile_codec: bool = True  # fuse the fp8 kernels at start (~14 s once); eager if not
    # longest a request waits for chunks another node is computing (a P/D prefill node's
    # saves, or another engine's single-flight reservation) before computing them itself
    wait_timeout_s: float = 5.0
    # reserve the missing chunks at lookup so that engines meeting the same new prefix at
    # once compute it once (kv_both only; the others wait for its chunks)
    single_flight: bool = True
    reserve_ttl_s: float = 10.0  # a producer that dies releases its reservation after this
    # load in the background (vLLM's asynchronous loads): a long load never holds up the
    # step other requests are decoding in; costs the loading request a step or two
    load_async: bool = False
    # a step's synchronous loads are written a layer at a time by a loader thread while
    # the forward runs, each attention layer waiting only for its own (CPU engines; on a
    # GPU loads stay whole, before the forward). Off by default: on the 2-core host here,
    # paired TTFT runs showed no gain (medians within about 1 ms either way, one run 10 ms
    # worse): the loader thread competes with the forward's threads for the cores
    load_layerwise: bool = False
    # skip a hit that measured speeds say is slower to load than to compute (a small model,
    # a slow link: connector.planner); loads only when computing it would take at least
    # planner_min_speedup times as long as loading it. The compute estimate is a forward's
    # average time per token, its fixed cost included, which overstates what a hit saves:
    # 2.0 is where a small model's hits stopped costing more than computing them (ttft.py)
    planner: bool = True
    planner_min_speedup: float = 2.0

    @property
    def same_host(self) -> bool:
        if self.transport != "auto":
            return self.transport == "shm"
        return _is_local(self.store)

    def client_options(self, timeout_s: float):
        """The options of a connector half's client: no retries (a hit that fails is
        computed instead); with transport tcp (or local_calls off), gRPC only."""
        from kvstore.client import ClientOptions

        return ClientOptions(
            timeout_s=timeout_s, retries=0, local_calls=self.local_calls and self.same_host
        )

    @classmethod
    def from_extra(cls, extra: Mapping[str, object] | None, block_size: int) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
        values = {name: _coerce(name, value, _TYPES[name]) for name, value in extra.items()}
        config = cls(**values)
        if config.chunk_tokens == 0:
            config = cls(**{**values, "chunk_tokens": block_size})
        config._check(block_size)
        return config

    def _check(self, block_size: int) -> None:
        def bad(key: str, why: str) -> ConnectorConfigError:
            return ConnectorConfigError(f"kv_connector_extra_config.{key} {why}")

        if not self.store or ":" not in self.store:
            raise bad(
                "store",
                "must be host:port, unix:PATH, several host:port separated by commas "
                f"(shards) or dns:NAME:PORT, got {self.store!r}",
            )
        if self.chunk_tokens <= 0 or self.chunk_tokens % block_size:
            raise bad(
                "chunk_tokens",
                f"must be a positive multiple of the engine's block size {block_size}, "
                f"got {self.chunk_tokens}",
            )
        if self.codec not in CODECS:
            raise bad("codec", f"must be one of {', '.join(CODECS)}, got {self.codec!r}")
        for key in (
            "lookup_timeout_s",
            "load_timeout_s",
            "save_timeout_s",
            "lease_ttl_s",
            "wait_timeout_s",
            "reserve_ttl_s",
            "planner_min_speedup",
        ):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be positive, got {getattr(self, key)}")
        if self.transport not in TRANSPORTS:
            raise bad(
                "transport", f"must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.save_queue_depth < 1:
            raise bad("save_queue_depth", f"must be at least 1, got {self.save_queue_depth}")
        if self.save_queue_bytes < 1:
            raise bad("save_queue_bytes", f"must be at least 1, got {self.save_queue_bytes}")


_TYPES = {
    "store": str,
    "chunk_tokens": int,
    "codec": str,
    "namespace_salt": str,
    "lookup_timeout_s": float,
    "load_timeout_s": float,
    "save_timeout_s": float,
    "save_queue_depth": int,
    "save_queue_bytes": int,
    "save_generated": bool,
    "lease_ttl_s": float,
    "transport": str,
    "local_calls": bool,
    "compile_codec": bool,
    "wait_timeout_s": float,
    "single_flight": bool,
    "reserve_ttl_s": float,
    "load_async": bool,
    "load_layerwise": bool,
    "planner": bool,
    "planner_min_speedup": float,
}
TRANSPORTS = ("auto", "shm", "tcp")


def _is_local(address: str) -> bool:
    """Every store the address names runs on this host (a DNS name: assume not)."""
    from kvstore.rpc.local_wire import on_this_host

    return all(on_this_host(a.strip()) for a in address.split(","))
