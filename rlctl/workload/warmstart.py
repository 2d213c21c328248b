"""Supervised warm-start: the initial policy that the RL phase starts from.

Role: make the reference job's RL phase meaningful on a CPU. A randomly initialised model never
produces a correct answer, so GRPO would have no signal; this module trains the ``GPT`` for a short
while (default 600 AdamW steps of 32 sequences; 0.12 CPU-seconds a step on one thread, so about
70 CPU-seconds, 1 to 1.5 minutes on 2 idle cores) with next-token cross-entropy on
the *reference answers* of ``make_dataset`` prompts, loss on response tokens only. Batches are
length-bucketed (sorted by length, cut into batches, batch order shuffled) so the long-tail
prompts do not pad every batch. The result is a partly competent policy: sampling at temperature 1
gets some answers right and many wrong, which is where RL has room to improve.

``prepare_initial_checkpoint(path, seed, config)`` caches the result: a model file (``save_model``
format, written atomically) plus a ``.json`` sidecar holding a hash of (recipe version, seed,
config) and the training figures. A file whose sidecar hash matches is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlctl.workload.grpo import cross_entropy_on_mask
from rlctl.workload.model import GPT, MODEL_FORMAT, ModelConfig, build_model
from rlctl.workload.task import TOKENIZER, Prompt, make_dataset
from rlctl.workload.trainer import atomic_torch_save

RECIPE_VERSION = 1
WARMSTART_DATA_SEED_OFFSET = 1_000_003  # warm-start prompts never reuse the RL prompt seeds


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm-start recipe; every field goes into the cache hash."""

    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 30
    dataset_size: int = 8000
    max_expected_len: int | None = None
    torch_threads: int = 0  # 0: leave torch's default
    mix: dict[str, float] | None = None  # task family weights of the warm-start data (None: the task's default)
    length_alpha: float | None = None  # Pareto shape of long answers in the warm-start data (None: the task's)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for optional in ("mix", "length_alpha"):
            if data[optional] is None:
                del data[optional]  # recipes from before the field existed keep their cache hash
        return data


def config_hash(seed: int, config: WarmStartConfig) -> str:
    blob = json.dumps({"recipe": RECIPE_VERSION, "seed": seed, "config": config.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def supervised_example(prompt: Prompt) -> tuple[list[int], int]:
    """Prompt + reference answer + EOS, and the prompt length (where the response starts)."""
    response = TOKENIZER.encode(str(prompt.meta["answer"]), add_eos=True)
    return prompt.tokens + response, len(prompt.tokens)


def length_bucketed_batches(prompts: Sequence[Prompt], batch_size: int, rng: random.Random) -> list[list[Prompt]]:
    """Sort by sequence length, cut into batches, shuffle the batch order."""
    ordered = sorted(prompts, key=lambda p: (len(p.tokens) + int(p.meta["expected_len"]), p.prompt_id))
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(batches)
    return batches


def batch_tensors(prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[B, T]`` and a mask ``[B, T]`` that is 1 on response tokens."""
    examples = [supervised_example(p) for p in prompts]
    width = max(len(seq) for seq, _ in examples)
    ids = torch.full((len(examples), width), TOKENIZER.pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, (sequence, start) in enumerate(examples):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, start:len(sequence)] = 1.0
    return ids, mask


def train_supervised(seed: int, config: WarmStartConfig) -> tuple[GPT, dict[str, float]]:
    """Run the recipe; deterministic for (seed, config) on a given machine and thread count."""
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    started = time.perf_counter()
    model = build_model(config.model, seed=seed)
    prompts = make_dataset(config.dataset_size, seed + WARMSTART_DATA_SEED_OFFSET, mix=config.mix,
                           max_expected_len=config.max_expected_len, length_alpha=config.length_alpha)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps) * max(0.1, 1.0 - step / config.steps))
    batches: list[list[Prompt]] = []
    losses: list[float] = []
    model.train()
    for _ in range(config.steps):
        if not batches:
            batches = length_bucketed_batches(prompts, config.batch_size, rng)
        ids, mask = batch_tensors(batches.pop())
        loss = cross_entropy_on_mask(model(ids), ids, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    tail = losses[-20:]
    return model.eval(), {"final_loss": sum(tail) / len(tail), "first_loss": losses[0],
                          "seconds": time.perf_counter() - started, "steps": float(config.steps)}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def cached_is_valid(path: Path, expected_hash: str) -> bool:
    sidecar = _sidecar(path)
    if not (path.is_file() and sidecar.is_file()):
        return False
    try:
        return json.loads(sidecar.read_text()).get("config_hash") == expected_hash
    except (OSError, ValueError):
        return False


def prepare_initial_checkpoint(path: str | Path, seed: int = 0, config: WarmStartConfig | None = None) -> Path:
    """The warm-started model file at ``path``: reused when its sidecar hash matches, else trained.

    Blocking (tens of seconds when it trains). Idempotent. Returns ``path``.
    """
    config = config or WarmStartConfig()
    target = Path(path)
    expected = config_hash(seed, config)
    if cached_is_valid(target, expected):
        return target
    model, figures = train_supervised(seed, config)
    payload = {"format": MODEL_FORMAT, "config": model.config.to_dict(),
               "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    atomic_torch_save(payload, target)
    sidecar = _sidecar(target)
    tmp = sidecar.with_name(f".{sidecar.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"config_hash": expected, "seed": seed, "config": config.to_dict(), **figures},
                              indent=2, sort_keys=True))
    os.replace(tmp, sidecar)
    return target
