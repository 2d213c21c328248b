"""Deterministic inputs shared by the GPU check and ``bench/engine_throughput.py``.

Prompts come from the reference task (``rlctl.workload.task``), so engines see real prompt
lengths; training samples are scored for real like ``tests/workload/batches.py``.
"""

from __future__ import annotations

import random
from typing import Any

from rlctl.workload.task import TOKENIZER, make_dataset, score


def make_requests(count: int, seed: int = 0) -> list[Any]:
    """``count`` ``GenRequest`` s over task prompts (cycled), each with its own seed."""
    from rlctl.workload.engine import GenRequest

    prompts = make_dataset(max(1, min(count, 64)), seed)
    return [GenRequest(f"r{i}", list(prompts[i % len(prompts)].tokens), seed * 100_003 + i) for i in range(count)]


def synthetic_samples(seed: int, prompts: int = 8, group_size: int = 8) -> list[Any]:
    """A GRPO batch: task prompts with random-ish responses (some exactly right), scored."""
    from rlctl.workload.trainer import TrainSample

    rng = random.Random(seed)
    samples = []
    for prompt in make_dataset(prompts, seed, max_expected_len=24):
        answer = str(prompt.meta["answer"])
        for k in range(group_size):
            text = answer if rng.random() < 0.4 else "".join(rng.choice("0123456789 abc") for _ in range(rng.randint(1, 8)))
            response = TOKENIZER.encode(text, add_eos=True)
            reward, _ = score(prompt.meta, response)
            samples.append(TrainSample(f"{prompt.prompt_id}/{k}", prompt.prompt_id, k, list(prompt.tokens),
                                       response, reward))
    return samples
