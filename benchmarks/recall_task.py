"""A synthetic long-context recall task and the tiny Llama trained on it (CPU, minutes).

The answer depends on exact recall from the prefix: a *haystack* of filler tokens
holds every key of a small key set once, each followed by its value; the questions
after it repeat a key and the model must answer the value that followed it, up to
4K tokens back. A model that attends to the wrong place, or whose cached keys are
too distorted to find the right one, answers wrong. Token ids::

    0 BOS | 1 unused | 2..K+1 keys | K+2..K+V+1 values

The filler is random value tokens, never preceded by a key: guessing among the
values seen in context does not work, only finding the key does.

Training (``train``) runs a curriculum so that it fits in a few CPU minutes: dense
repeats of few keys until the induction circuit forms (a phase change), then
haystacks of growing length. Each phase ends when its running accuracy passes a
threshold or its step budget is spent. ``load_or_train`` keeps the model under
``benchmarks/results/models/`` (git-ignored) and trains only when it is missing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MODEL_DIR = Path(__file__).resolve().parent / "results" / "models" / "recall-llama"


@dataclass(frozen=True)
class Task:
    n_keys: int = 64
    n_values: int = 256

    key0 = 2  # 0 is BOS, 1 is unused

    @property
    def value0(self) -> int:
        return self.key0 + self.n_keys

    @property
    def vocab_size(self) -> int:
        return self.value0 + self.n_values


def dense_batch(task: Task, gen: torch.Generator, batch: int, pairs: int):
    """Key-value pairs drawn from a few keys, so most keys repeat soon; every repeat is a label."""
    distinct = torch.randint(2, min(pairs, task.n_keys) + 1, (batch, 1), generator=gen)
    keys = torch.rand(batch, task.n_keys, generator=gen).argsort(dim=1)
    values = torch.randint(task.n_values, (batch, task.n_keys), generator=gen)
    idx = (torch.rand(batch, pairs, generator=gen) * distinct).long()
    k, v = keys.gather(1, idx), values.gather(1, idx)
    ordered, perm = idx.sort(dim=1, stable=True)
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat.scatter_(1, perm[:, 1:], ordered[:, 1:] == ordered[:, :-1])
    tokens = torch.zeros(batch, 1 + 2 * pairs, dtype=torch.long)
    tokens[:, 1::2] = task.key0 + k
    tokens[:, 2::2] = task.value0 + v
    labels = torch.full_like(tokens, -100)
    labels[:, 1::2] = torch.where(repeat, task.value0 + v, -100)
    return tokens, labels


def haystack_batch(task: Task, gen: torch.Generator, batch: int, prefix: int, questions: int):
    """``prefix`` tokens (BOS + haystack with every key once), then ``questions`` key-value pairs.

    Labels sit on the question keys (the logits there predict the value).
    """
    slots = (prefix - 1) // 2
    pairs = min(task.n_keys, slots)
    total = prefix + 2 * questions
    tokens = torch.randint(task.value0, task.vocab_size, (batch, total), generator=gen)
    tokens[:, 0] = 0
    keys = torch.rand(batch, task.n_keys, generator=gen).argsort(dim=1)[:, :pairs]
    values = torch.randint(task.n_values, (batch, pairs), generator=gen)
    pos = 1 + 2 * torch.rand(batch, slots, generator=gen).argsort(dim=1)[:, :pairs]
    tokens.scatter_(1, pos, task.key0 + keys)
    tokens.scatter_(1, pos + 1, task.value0 + values)
    asked = torch.randint(pairs, (batch, questions), generator=gen)
    at = (prefix + 2 * torch.arange(questions)).expand(batch, questions)
    tokens.scatter_(1, at, task.key0 + keys.gather(1, asked))
    tokens.scatter_(1, at + 1, task.value0 + values.gather(1, asked))
    labels = torch.full_like(tokens, -100)
    labels.scatter_(1, at, task.value0 + values.gather(1, asked))
    return tokens, labels


def new_model(task: Task, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=task.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # head_dim 64, as in most served models
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# (name, tokens per example (cycled step by step), questions, accuracy that ends the
# phase, most steps). Budgets are in steps, so a slower machine trains the same model,
# only later; PHASE_MAX_S is a safety stop. The last phase mixes lengths: trained on 4K
# alone, the model forgot 1K (80 % there against 87 % at 4K in one try).
CURRICULUM = [
    ("dense", (32,), 0, 0.97, 400),
    ("haystack-256", (256,), 32, 0.97, 150),
    ("haystack-1024", (1024,), 64, 0.97, 200),
    ("haystack-1k-4k", (1024, 2048, 4096), 64, 0.98, 300),
]
PHASE_MAX_S = 900.0
TOKENS_PER_STEP = 16384
FORMED = 0.9


def _run_phase(model, opt, task, gen, phase, log, t_start, step):
    name, lengths, questions, goal, max_steps = phase
    t_phase, running, first_step = time.perf_counter(), 0.0, step
    while True:
        length = lengths[step % len(lengths)]
        batch = max(1, TOKENS_PER_STEP // (length + 2 * questions))
        if questions:
            x, y = haystack_batch(task, gen, batch, length, questions)
        else:
            x, y = dense_batch(task, gen, batch, length // 2)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, task.vocab_size), y.reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        labelled = y != -100
        acc = (logits.argmax(-1)[labelled] == y[labelled]).float().mean().item()
        running = acc if step == 1 else 0.8 * running + 0.2 * acc
        spent = time.perf_counter() - t_phase
        if step % 10 == 0:
            log(
                f"train {name:14s} step {step:4d}  loss {loss.item():6.3f}  "
                f"acc {running:5.3f}  {time.perf_counter() - t_start:5.0f}s"
            )
        if running >= goal or step - first_step >= max_steps or spent >= PHASE_MAX_S:
            return step, {"phase": name, "steps": step, "seconds": round(spent, 1), "acc": running}


def train(
    out_dir: Path = MODEL_DIR,
    seeds: tuple[int, ...] = (0, 1, 2, 3),
    log: Callable[..., None] = print,
    curriculum=CURRICULUM,
) -> dict:
    """Train, save (HF format + ``task.json``), return the training record.

    Whether the induction circuit forms within the first phase's steps depends on the
    initialisation (seed 0 forms it after about 100 steps here); a seed whose first
    phase ends below ``FORMED`` accuracy is abandoned for the next.
    """
    task = Task()
    t_start = time.perf_counter()
    abandoned = []
    for seed in seeds:
        model = new_model(task, seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01, betas=(0.9, 0.98))
        gen = torch.Generator().manual_seed(seed + 1)
        step, first = _run_phase(model, opt, task, gen, curriculum[0], log, t_start, 0)
        if first["acc"] >= FORMED:
            break
        log(f"seed {seed}: no recall circuit after {first['steps']} steps; trying the next seed")
        abandoned.append(seed)
    else:
        raise RuntimeError(f"the recall circuit did not form with seeds {seeds}")
    phases = [first]
    for phase in curriculum[1:]:
        step, done = _run_phase(model, opt, task, gen, phase, log, t_start, step)
        phases.append(done)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    record = {
        "task": asdict(task),
        "seed": seed,
        "abandoned_seeds": abandoned,
        "phases": phases,
        "train_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out_dir / "task.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def load_or_train(path: Path = MODEL_DIR, retrain: bool = False, log=print):
    """The trained model, its task and training record; trains first when needed."""
    from transformers import LlamaForCausalLM

    if retrain or not (path / "task.json").exists():
        log(f"training the recall model (a few minutes on CPU) into {path}", flush=True)
        train(path, log=log)
    record = json.loads((path / "task.json").read_text())
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, Task(**record["task"]), record


if __name__ == "__main__":
    import sys

    print(json.dumps(train(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_DIR)))
