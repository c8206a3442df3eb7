"""What the connector says or refuses at start, on vLLM's own ``VllmConfig`` (no engine).

Pipeline parallelism is refused with a message that says why; an engine whose failed
loads would fail requests (vLLM's default ``kv_load_failure_policy``) is warned about;
every setting of ``ConnectorConfig`` is taken from ``kv_connector_extra_config``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from connector.config import ConnectorConfig, ConnectorConfigError

pytest.importorskip("vllm")

from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from connector.vllm import KVStoreConnector  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.connector.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def vllm_config(model: Path, pp: int = 1, **transfer) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=2048),
        cache_config=CacheConfig(block_size=32),
        parallel_config=ParallelConfig(pipeline_parallel_size=pp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "127.0.0.1:1", "codec": "raw"},
            **transfer,
        ),
    )


def test_pipeline_parallelism_is_refused_with_the_reason(model):
    with pytest.raises(ConnectorConfigError, match="does not support pipeline parallelism"):
        KVStoreConnector(vllm_config(model, pp=2), KVConnectorRole.SCHEDULER, None)


def test_a_policy_that_fails_requests_on_a_failed_load_is_warned_about(model, caplog):
    with caplog.at_level(logging.WARNING, logger="connector.vllm"):
        KVStoreConnector(vllm_config(model), KVConnectorRole.SCHEDULER, None).shutdown()
    assert "kv_load_failure_policy is 'fail'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="connector.vllm"):
        config = vllm_config(model, kv_load_failure_policy="recompute")
        KVStoreConnector(config, KVConnectorRole.SCHEDULER, None).shutdown()
    assert "kv_load_failure_policy" not in caplog.text


def test_every_setting_can_be_given_in_the_extra_config():
    defaults = dataclasses.replace(ConnectorConfig(), chunk_tokens=32)
    extra = {
        f.name: getattr(defaults, f.name)
        for f in dataclasses.fields(ConnectorConfig)
        if getattr(defaults, f.name) is not None  # namespace_salt: None is "not given"
    }
    assert ConnectorConfig.from_extra(extra, 32) == defaults
    flipped = {k: not v for k, v in extra.items() if isinstance(v, bool)}
    got = ConnectorConfig.from_extra({**extra, **flipped}, 32)
    assert {k: getattr(got, k) for k in flipped} == flipped
