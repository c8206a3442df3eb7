"""kvstore's vLLM KV-connector plugin (``connector.vllm.KVStoreConnector``).

The store never imports it, and it reaches the store only through ``kvstore.client``.
"""
