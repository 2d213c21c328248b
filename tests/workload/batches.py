"""Deterministic synthetic GRPO batches and a small random-init HF model, shared by the trainer
tests and the DP worker script."""

from __future__ import annotations

import random
from typing import Any

from rlctl.workload.hf_init import ModelSize, random_policy
from rlctl.workload.task import TOKENIZER, make_dataset, score
from rlctl.workload.trainer import TrainSample

# Token ids here are the reference task's (below 43): a vocabulary of 64 holds them.
SMALL = ModelSize(hidden=64, layers=2, heads=1, kv_heads=1, intermediate=128, vocab=64, max_positions=256)


def small_model(seed: int) -> Any:
    """A random-init Qwen3 of shape ``SMALL`` (an ``HFPolicy``), made in memory."""
    return random_policy("qwen3", SMALL, seed)


def synthetic_batch(seed: int, prompts: int = 4, group_size: int = 4) -> list[TrainSample]:
    """Prompts from the task with random-ish responses (some exactly right), scored for real."""
    rng = random.Random(seed)
    samples: list[TrainSample] = []
    for prompt in make_dataset(prompts, seed, max_expected_len=24):
        for k in range(group_size):
            answer = str(prompt.meta["answer"])
            text = answer if rng.random() < 0.4 else "".join(rng.choice("0123456789 abc") for _ in range(rng.randint(1, 8)))
            response = TOKENIZER.encode(text, add_eos=True)
            reward, _ = score(prompt.meta, response)
            samples.append(TrainSample(f"{prompt.prompt_id}/{k}", prompt.prompt_id, k, list(prompt.tokens),
                                       response, reward))
    return samples
