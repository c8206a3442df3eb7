"""The pure parts the TTFT and accuracy benchmarks rest on: task data, model shape, naive fp8."""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import fp8_per_tensor
from benchmarks.recall_task import Task, dense_batch, haystack_batch
from benchmarks.ttft import (
    LLAMA3_8B,
    SHAPE,
    first_and_repeat,
    percentile,
    shape_report,
    store_over_local,
)

TASK = Task()


def test_haystack_questions_ask_keys_of_the_prefix_and_label_their_values():
    gen = torch.Generator().manual_seed(3)
    tokens, labels = haystack_batch(TASK, gen, 4, 1024, 16)
    assert tokens.shape == labels.shape == (4, 1024 + 32)
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        prefix = row[:1024]
        assert prefix[0] == 0
        keys_at = [i for i, t in enumerate(prefix) if TASK.key0 <= t < TASK.value0]
        assert len(keys_at) == TASK.n_keys  # every key once
        value_of = {prefix[i]: prefix[i + 1] for i in keys_at}
        assert all(TASK.value0 <= v < TASK.vocab_size for v in value_of.values())
        asked = [i for i, y in enumerate(lab) if y != -100]
        assert asked == list(range(1024, 1024 + 32, 2))
        for i in asked:
            assert lab[i] == row[i + 1] == value_of[row[i]]
        # filler is values only: a key never appears except in a pair or a question
        assert sum(TASK.key0 <= t < TASK.value0 for t in row) == TASK.n_keys + 16


def test_dense_batch_labels_only_repeated_keys_with_their_first_value():
    gen = torch.Generator().manual_seed(4)
    tokens, labels = dense_batch(TASK, gen, 8, 16)
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        seen = {}
        for i in range(1, len(row), 2):
            key, value = row[i], row[i + 1]
            if key in seen:
                assert lab[i] == value == seen[key]
            else:
                assert lab[i] == -100
                seen[key] = value


def test_benchmark_model_keeps_llama3_8b_compute_to_kv_ratios():
    ours, ref = shape_report(SHAPE), shape_report(LLAMA3_8B)
    assert ref["kv_bytes_per_token_fp16"] == 128 * 1024  # 128 KiB per token in FP16
    assert 13e9 < ref["dense_flops_per_token"] < 15e9  # 2 x 7B non-embedding parameters
    assert ours["flops_per_kv_byte"] == pytest.approx(ref["flops_per_kv_byte"], rel=0.02)
    assert ours["attention_breakeven_context"] == pytest.approx(
        ref["attention_breakeven_context"], rel=0.02
    )


def test_naive_fp8_uses_one_scale_so_small_values_lose_precision():
    x = torch.tensor([[1000.0, 1.0, 0.01]])
    y = fp8_per_tensor(x)
    assert y[0, 0] == pytest.approx(1000.0, rel=0.07)
    assert y[0, 2] != pytest.approx(0.01, rel=0.07)  # under the shared scale's resolution
    assert fp8_per_tensor(torch.zeros(2, 2)).abs().sum() == 0


def test_p90_is_the_nearest_rank_sample():
    assert percentile([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert percentile([5.0, 1.0, 3.0], 0.9) == 5.0  # few samples: the largest
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.9) == 6.0
    assert percentile([7.0], 0.9) == 7.0


def test_store_over_local_pairs_each_round_and_splits_out_the_engine():
    # the paired ratio is the median of each round's fp8 / raw, not a ratio of medians
    samples = {
        "vllm_prefix_cache": {4096: [20.0, 20.0, 20.0], 16384: []},
        "kvstore_raw": {4096: [30.0, 40.0, 60.0], 16384: [50.0]},
        "kvstore_fp8": {4096: [29.0, 58.0, 38.0], 16384: [49.0]},
    }
    split = {
        "kvstore_raw": {4096: [(0.0, 25.0, 9.0), (0.0, 26.0, 9.0), (0.0, 27.0, 9.0)]},
        "kvstore_fp8": {4096: [(0.0, 24.0, 12.0), (0.0, 23.0, 12.0), (0.0, 22.0, 12.0)]},
    }
    row = store_over_local(samples, split)["4096"]
    assert row["raw_over_local"] == 2.0 and row["fp8_over_local"] == 1.9
    assert row["fp8_over_raw"] == 0.95  # 38 / 40
    assert row["fp8_over_raw_paired"] == round(29 / 30, 3)  # of 29/30, 58/40, 38/60
    assert row["fp8_over_raw_engine"] == round(23 / 26, 3)
    assert "16384" not in store_over_local(samples, split)  # no local sample: no ratio
    del split["kvstore_fp8"]  # vLLM's histograms not read for one codec: no engine ratio
    assert "fp8_over_raw_engine" not in store_over_local(samples, split)["4096"]
    assert "fp8_over_raw_node_matched" not in row  # the fp8 node's own hits not measured


def test_store_over_local_matches_each_codec_with_its_own_nodes_warm_cache():
    # the fp8 node is 10 % slower than the raw node at its own hits: node matched, fp8's
    # 29 / 22 over raw's 30 / 20, not the 29 / 30 of the two nodes' store hits
    samples = {
        "vllm_prefix_cache": {4096: [20.0, 20.0, 40.0]},
        "kvstore_raw": {4096: [30.0, 30.0, 50.0]},
        "kvstore_fp8": {4096: [29.0, 29.0, 58.0]},
        "vllm_prefix_cache_fp8_node": {4096: [22.0, 22.0, 29.0]},
    }
    row = store_over_local(samples, {})["4096"]
    assert row["fp8_over_raw"] == round(29 / 30, 3)
    assert row["local_fp8_node_over_local"] == 1.1
    assert row["fp8_over_own_local"] == round(29 / 22, 3)
    assert row["fp8_over_raw_node_matched"] == round((29 / 22) / (30 / 20), 3)
    # per round: (29/22)/(30/20) twice, then (58/29)/(50/40) = 1.6; the median is the first
    assert row["fp8_over_raw_node_matched_paired"] == round((29 / 22) / (30 / 20), 3)


def test_first_and_repeat_splits_each_rounds_first_load_from_the_loads_again():
    # two rounds of three hits each; recompute is measured once a round and left out
    samples = {
        "kvstore_raw": {4096: [40.0, 30.0, 31.0, 44.0, 29.0, 32.0]},
        "vllm_prefix_cache": {4096: [20.0, 21.0, 22.0, 20.0, 23.0, 24.0]},
        "recompute": {4096: [900.0, 950.0, 990.0, 1000.0]},  # once a round: never split
    }
    out = first_and_repeat(samples, hits=3)
    assert out["kvstore_raw"]["4096"] == {"first": 42.0, "repeat": 30.5}  # 40, 44; 29-32
    assert out["vllm_prefix_cache"]["4096"] == {"first": 20.0, "repeat": 22.5}
    assert "recompute" not in out
    assert first_and_repeat(samples, hits=1) == {}  # one load a prefix: nothing to split
