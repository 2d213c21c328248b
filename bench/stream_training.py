"""Stream-based training against synchronous training: step time on a long-tail mix, same seed,
same samples.

Each step's batch is GRPO groups of the reference task's prompts with long-tailed response lengths
(a Pareto tail, as the task's ``down`` family: most responses a few tokens, a few near the cap). A
group is ready once its longest response has been decoded: generation runs on the rollout GPUs
while the trainer's GPUs wait, so its timeline is ``longest tokens x --decode-ms`` (a decode step on
a GPU costs about the same at any batch size). The rollout side is played by that timeline; the
training is real: the GRPO trainer on a small Hugging Face model (random init, made here), one
process, CPU.

- synchronous (the baseline): wait for the whole batch, then one ``train_step``;
- stream: ``begin_step``, then ``add_samples`` on each part of ``--parts`` groups (in completion
  order, as ``trainer.get_stream`` serves them) as soon as it is ready, then ``finish_step``.

Step time is from the round's start to the optimizer step done. Both arms start from the same
weights and train the same samples; the bench checks that they end with the same weights.

    python bench/stream_training.py [--steps 6] [--prompts 16] [--group 4] [--max-new 256] [--decode-ms 15] [--parts 4]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.workload.hf_init import ModelSize, random_policy
from rlctl.workload.task import make_dataset
from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample

SIZE = ModelSize(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=64, max_positions=512)


def long_tail_batch(seed: int, step: int, prompts: int, group: int, max_new: int) -> list[tuple[float, list[TrainSample]]]:
    """(longest response tokens, samples) per group; lengths Pareto-tailed up to ``max_new``."""
    rng = random.Random(f"{seed}/{step}")
    groups = []
    for prompt in make_dataset(prompts, seed * 1000 + step, max_expected_len=24):
        samples = []
        for k in range(group):
            length = min(max_new, max(1, int(rng.paretovariate(1.1) * 3)))
            response = [rng.randrange(3, 40) for _ in range(length)]
            samples.append(TrainSample(f"{prompt.prompt_id}/{k}", prompt.prompt_id, k, list(prompt.tokens), response,
                                       1.0 if rng.random() < 0.4 else 0.0))
        groups.append((float(max(len(s.response_tokens) for s in samples)), samples))
    return sorted(groups, key=lambda g: g[0])  # completion order


def make_trainer(seed: int) -> Trainer:
    torch.manual_seed(seed)
    return Trainer(random_policy("llama", SIZE, seed), TrainerConfig(lr=1e-4, micro_batch_tokens=2048), distributed=False)


def wait_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def synchronous_step(trainer: Trainer, groups: list[tuple[float, list[TrainSample]]], decode_s: float) -> float:
    began = time.perf_counter()
    wait_until(began + groups[-1][0] * decode_s)
    trainer.train_step([s for _, samples in groups for s in samples])
    return time.perf_counter() - began


def streamed_step(trainer: Trainer, groups: list[tuple[float, list[TrainSample]]], decode_s: float, parts: int) -> float:
    began = time.perf_counter()
    size = -(-len(groups) // parts)
    chunks = [groups[i:i + size] for i in range(0, len(groups), size)]
    first = [s for _, samples in chunks[0] for s in samples]
    for index, chunk in enumerate(chunks):
        wait_until(began + chunk[-1][0] * decode_s)  # the part is ready once its last group is
        samples = [s for _, group_samples in chunk for s in group_samples]
        if index == 0:
            trainer.begin_step(sum(len(s.response_tokens) for s in first) / len(chunk) * len(groups))
        trainer.add_samples(samples)
    trainer.finish_step()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--decode-ms", type=float, default=15.0, help="seconds of one decode step on the rollout GPUs, ms")
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    decode_s = args.decode_ms / 1000.0
    arms: dict[str, list[float]] = {"synchronous": [], "stream": []}
    trainers = {"synchronous": make_trainer(args.seed), "stream": make_trainer(args.seed)}
    generation: list[float] = []
    for step in range(args.steps):
        groups = long_tail_batch(args.seed, step, args.prompts, args.group, args.max_new)
        generation.append(groups[-1][0] * decode_s)
        arms["synchronous"].append(synchronous_step(trainers["synchronous"], groups, decode_s))
        arms["stream"].append(streamed_step(trainers["stream"], groups, decode_s, args.parts))
        print(f"[stream_training] step {step}: generation {generation[-1]:.2f}s, synchronous "
              f"{arms['synchronous'][-1]:.2f}s, stream {arms['stream'][-1]:.2f}s", file=sys.stderr, flush=True)
    drift = max((a - b).abs().max().item() for a, b in zip(trainers["synchronous"].model.state_dict().values(),
                                                          trainers["stream"].model.state_dict().values()))
    sync_mean, stream_mean = statistics.mean(arms["synchronous"]), statistics.mean(arms["stream"])
    result: dict[str, Any] = {
        "config": vars(args),
        "generation_s_mean": round(statistics.mean(generation), 3),
        "train_s_mean_synchronous": round(sync_mean - statistics.mean(generation), 3),
        "step_s_mean": {"synchronous": round(sync_mean, 3), "stream": round(stream_mean, 3)},
        "step_s": {arm: [round(t, 3) for t in times] for arm, times in arms.items()},
        "speedup": round(sync_mean / stream_mean, 3),
        "weights_max_abs_difference": drift,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
