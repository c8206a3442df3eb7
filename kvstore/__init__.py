"""kvstore: a tiered KV-cache block store for LLM serving.

Layers, imports pointing one way:
``types/keys/payload/codec`` (pure) -> ``index`` (pure) -> ``tiers`` -> ``store``
-> ``service``/``client`` -> ``cli``/``server``/``connector``. The store never imports
the connector, and the client never imports the server (``make lint`` checks both).
"""

__version__ = "0.1.0"
