"""One vLLM engine in its own process, driven over stdin/stdout with JSON lines.

    python engine_driver.py MODEL_DIR CONNECTOR_JSON|none

Prints (after the ``@@engine`` marker) ``{"ready": ...}`` once the engine is up
(or ``{"error": ...}`` and exits 1 if it refused to start), then answers each
request line
``{"prompt": [token ids], "max_tokens": n}`` with
``{"tokens": [...], "logprobs": [...], "num_cached_tokens": n, "seconds": s}``.
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


MARK = "@@engine "  # vLLM logs to stdout too; replies carry this prefix


def say(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    model, connector = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if connector != "none":
        kwargs["kv_transfer_config"] = json.loads(connector)
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=model,
            dtype="float32",
            enforce_eager=True,
            block_size=32,
            max_model_len=2048,
            enable_prefix_caching=False,
            seed=0,
            **kwargs,
        )
    except Exception as exc:  # the test reads why the engine refused to start
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    say({"ready": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), logprobs=0)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)
        done = out[0].outputs[0]
        say(
            {
                "tokens": list(done.token_ids),
                "logprobs": [
                    lp[tok].logprob for lp, tok in zip(done.logprobs or [], done.token_ids)
                ],
                "num_cached_tokens": out[0].num_cached_tokens or 0,
                "seconds": time.perf_counter() - t,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
