"""One vLLM engine in its own process, driven over stdin/stdout with JSON lines.

    python engine_driver.py MODEL_DIR CONNECTOR_JSON|none [LLM_KWARGS_JSON]

Prints (after the ``@@engine`` marker) ``{"ready": ...}`` once the engine is up
(or ``{"error": ...}`` and exits 1 if it refused to start), then answers each
request line
``{"prompt": [token ids], "max_tokens": n}`` with
``{"tokens": [...], "logprobs": [...], "num_cached_tokens": n, "seconds": s}``.

A request may also name a ``cache_salt`` and a ``lora`` adapter
(``{"name", "id", "path"}``), and set ``ignore_eos``. ``{"batch": [request, ...], "max_tokens": n}``
runs its requests concurrently in one ``generate`` and answers
``{"outputs": [answer, ...], "seconds": s}``; ``{"metrics": true}`` answers
vLLM's counters as ``{"metrics": {name: value}}`` (the engine must be started
with ``disable_log_stats: false``). ``LLM_KWARGS_JSON`` overrides the engine's
arguments (a small ``num_gpu_blocks_override`` forces preemptions).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# equal torch thread counts with and without a connector, so outputs compare exactly
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# The engine core runs in this process unless the caller asks for vLLM's own layout
# (``1``: a separate engine-core process, as ``vllm serve`` runs it). The connector's
# two halves share one process either way; in-process starts in ~15 s of CPU against
# ~37 s, which is most of the suite's time. Compare only engines of the same layout.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


MARK = "@@engine "  # vLLM logs to stdout too; replies carry this prefix


def say(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def prompt_and_lora(req: dict):
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompt = TokensPrompt(prompt_token_ids=req["prompt"])
    if req.get("cache_salt"):
        prompt["cache_salt"] = req["cache_salt"]
    lora = req.get("lora")
    return prompt, LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None


def answer(out) -> dict:
    done = out.outputs[0]
    return {
        "tokens": list(done.token_ids),
        "logprobs": [lp[tok].logprob for lp, tok in zip(done.logprobs or [], done.token_ids)],
        "num_cached_tokens": out.num_cached_tokens or 0,
    }


def metrics(llm) -> dict:
    """Counters and gauges summed over their labels."""
    values: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            values[m.name] = values.get(m.name, 0) + value
    return values


def main() -> int:
    model, connector = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams

    kwargs = {}
    if connector != "none":
        kwargs["kv_transfer_config"] = json.loads(connector)
    if len(sys.argv) > 3:
        kwargs.update(json.loads(sys.argv[3]))
    t0 = time.perf_counter()
    try:
        llm = LLM(
            **{
                "model": model,
                "dtype": "float32",
                "enforce_eager": True,
                "block_size": 32,
                "max_model_len": 2048,
                "enable_prefix_caching": False,
                "seed": 0,
                **kwargs,
            }
        )
    except Exception as exc:  # the test reads why the engine refused to start
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    say({"ready": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        if req.get("metrics"):
            say({"metrics": metrics(llm)})
            continue
        batch = req.get("batch", [req])
        params = SamplingParams(
            temperature=0.0,
            max_tokens=req.get("max_tokens", 8),
            logprobs=0,
            ignore_eos=req.get("ignore_eos", False),
        )
        prompts, loras = zip(*(prompt_and_lora(r) for r in batch))
        lora = list(loras) if any(loras) else None
        outs = llm.generate(list(prompts), params, use_tqdm=False, lora_request=lora)
        answers = [answer(out) for out in outs]
        seconds = time.perf_counter() - t
        if "batch" in req:
            say({"outputs": answers, "seconds": seconds})
        else:
            say({**answers[0], "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
