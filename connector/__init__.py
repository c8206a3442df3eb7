"""kvstore's vLLM KV-connector plugin (``connector.vllm.KVStoreConnector``)."""
