"""kvstore: a tiered KV-cache block store for LLM serving.

Layers, imports pointing one way:
``types/keys/payload/codec`` (pure) -> ``index`` (pure) -> ``tiers`` -> ``store``
-> ``service``/``client`` -> ``cli``/``server``/``connector``.
"""

__version__ = "0.1.0"
