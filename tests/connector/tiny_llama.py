"""A tiny Llama with random weights and a tokenizer trained here: no hub, no download.

``build_tiny_llama(out_dir, ...)`` writes config, safetensors, tokenizer and a
greedy generation config that transformers and vLLM both load. Same arguments
and seed give byte-identical files. ``build_lora_adapter(out_dir, model_dir)``
writes a PEFT-format LoRA adapter with random weights for that model.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def _training_files(max_bytes: int) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        size = os.path.getsize(path)
        if total + size <= max_bytes:
            files.append(path)
            total += size
    if not files:
        raise RuntimeError(f"no training text found under {stdlib}")
    return files


def build_tokenizer(
    vocab_size: int = 1000, max_train_bytes: int = 2_000_000, model_max_length: int = 4096
):
    """Byte-level BPE trained on the standard library's own sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(max_train_bytes), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,  # default hidden_size // num_attention_heads
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.2,  # wide logit gaps: greedy choices are not near-ties
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_max_length=max_position_embeddings)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, safe_serialization=True)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    )
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    return out


def build_lora_adapter(
    out_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    *,
    rank: int = 8,
    scale: float = 0.5,  # large enough that the adapter changes greedy outputs
    seed: int = 1,
) -> Path:
    """A LoRA adapter (PEFT layout, no peft needed) on q_proj and v_proj of every layer."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
    }
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(layers):
        for module, out_features in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=g)
            b = torch.randn(out_features, rank, generator=g)
            weights[f"{prefix}.lora_A.weight"] = a * scale
            weights[f"{prefix}.lora_B.weight"] = b * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted(outs),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1]))
