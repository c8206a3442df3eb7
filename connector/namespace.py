"""The kvstore namespace of an engine: what must match for two engines to share KV.

Offers ``engine_namespace(vllm_config, chunk_tokens, codec, salt)``. Never leaves out what
changes the bytes (model, revision, geometry, KV dtype, codec, TP size): two engines that
would compute different KV never share a namespace.
"""

from __future__ import annotations

from kvstore.core.keys import Namespace


def engine_namespace(vllm_config, chunk_tokens: int, codec: str, salt: str | None) -> Namespace:
    """Model identity and KV geometry from the engine's config.

    The KV cache dtype goes into the salt: chunks stored by a bf16 engine are
    not bit-identical to what an fp32 engine would compute, so they are not
    shared between the two.
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    kv_dtype = str(vllm_config.cache_config.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    parts = [f"kv_dtype={kv_dtype}"] + ([salt] if salt else [])
    return Namespace(
        model=str(model.model),
        revision=str(model.revision or "main"),
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        chunk_tokens=chunk_tokens,
        codec=codec,
        tp_size=parallel.tensor_parallel_size,
        salt=";".join(parts),
    )
