"""Learning on the HF path: GRPO on a tiny Qwen3 with the GSM8K-layout parquet and the built-in
``gsm8k`` reward raises held-out reward, against the same policy before RL (the baseline), per seed.

Per seed, in this process (no controller: the compute the roles run, end to end):
1. ``rlctl data gsm8k``'s rows (train/test) and ``rlctl model init --arch qwen3 --size tiny``;
2. the supervised warm-start on the train file's reference solutions (``extra_info.answer``);
3. held-out reward before RL: every test prompt x ``--eval-samples`` samples at temperature 1,
   fixed per-sample seeds, scored with ``gsm8k``;
4. ``--steps`` GRPO steps of ``--prompts`` train prompts x ``--group`` samples (on-policy: the
   engine loads every new version), scored with ``gsm8k``;
5. held-out reward after RL with the same seeds. The difference is paired per prompt; its
   standard error is over prompts.

    python bench/hf_learning.py [--seeds 0 1 2] [--steps 40] [--warmstart-steps 300] [--lr 1e-4]

Prints one line per seed, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.core.rounds import PromptRef
from rlctl.workload.datafiles import read_records
from rlctl.workload.engine import GenRequest, SamplingConfig, TorchEngine
from rlctl.workload.gsm8k_layout import write_dataset
from rlctl.workload.hf_init import init_checkpoint
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
from rlctl.workload.hf_warmstart import HFWarmStartConfig, train
from rlctl.workload.prompts import tokenize_records
from rlctl.workload.rewardfn import gsm8k_score
from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample


def score(tokenizer: ChatTokenizer, prompt: PromptRef, response: list[int]) -> float:
    return float(gsm8k_score("openai/gsm8k", tokenizer.decode(response), prompt.meta["ground_truth"])["score"])


def held_out(engine: TorchEngine, tokenizer: ChatTokenizer, prompts: list[PromptRef], samples: int,
             max_new: int) -> list[float]:
    """Mean reward per prompt over ``samples`` samples with fixed seeds."""
    requests = [GenRequest(f"{p.prompt_id}/{k}", list(p.tokens), 10_000_019 * k + i)
                for i, p in enumerate(prompts) for k in range(samples)]
    results = {r.item_id: r for r in engine.generate(requests, max_new)}
    return [statistics.mean(score(tokenizer, p, results[f"{p.prompt_id}/{k}"].response_tokens) for k in range(samples))
            for p in prompts]


def run_seed(seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    data = write_dataset(work / "data", args.train_rows, args.test_rows, seed)
    base = init_checkpoint(work / "base", "qwen3", "tiny", seed)
    warm = work / "warm"
    warm_figures = train(base, warm, data["train"], seed, HFWarmStartConfig(steps=args.warmstart_steps))
    tokenizer = ChatTokenizer(warm)
    stops = stop_token_ids(warm)
    train_prompts = tokenize_records(read_records([data["train"]]), warm, 1024).prompts
    test_prompts = tokenize_records(read_records([data["test"]]), warm, 1024, "e").prompts
    sampling = SamplingConfig(temperature=1.0, eos_id=stops[0], pad_id=tokenizer.pad_id or 0, stop_ids=tuple(stops))
    engine = TorchEngine(load_hf_policy(warm), sampling)
    before = held_out(engine, tokenizer, test_prompts, args.eval_samples, args.max_new)
    trainer = Trainer.from_hf(warm, TrainerConfig(lr=args.lr, warmup_steps=2), distributed=False)
    order = list(range(len(train_prompts)))
    random.Random(seed).shuffle(order)
    train_rewards = []
    for step in range(args.steps):
        chosen = [train_prompts[order[(step * args.prompts + i) % len(order)]] for i in range(args.prompts)]
        requests = [GenRequest(f"{p.prompt_id}/{k}", list(p.tokens), hash((seed, step, p.prompt_id, k)) & 0x7FFFFFFF)
                    for p in chosen for k in range(args.group)]
        results = {r.item_id: r for r in engine.generate(requests, args.max_new)}
        samples = []
        for group, prompt in enumerate(chosen):
            for k in range(args.group):
                response = results[f"{prompt.prompt_id}/{k}"].response_tokens
                samples.append(TrainSample(f"{prompt.prompt_id}/{k}", prompt.prompt_id, group, list(prompt.tokens),
                                           response, score(tokenizer, prompt, response)))
        train_rewards.append(statistics.mean(s.reward for s in samples))
        trainer.train_step(samples)
        engine.load_state_dict(trainer.state_dict_for_publish(), step + 1)
    after = held_out(engine, tokenizer, test_prompts, args.eval_samples, args.max_new)
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"seed": seed, "held_out_before": round(statistics.mean(before), 4),
            "held_out_after": round(statistics.mean(after), 4), "gain": round(statistics.mean(diffs), 4),
            "gain_se": round(se, 4), "gain_over_2se": statistics.mean(diffs) > 2 * se,
            "train_reward_first5": round(statistics.mean(train_rewards[:5]), 4),
            "train_reward_last5": round(statistics.mean(train_rewards[-5:]), 4),
            "warmstart_final_loss": round(warm_figures["final_loss"], 3), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--warmstart-steps", type=int, default=300)
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=128)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as folder:
            run = run_seed(seed, args, Path(folder))
        runs.append(run)
        print(f"seed {seed}: held-out {run['held_out_before']:.3f} -> {run['held_out_after']:.3f} "
              f"(gain {run['gain']:+.3f}, s.e. {run['gain_se']:.3f}), {run['seconds']:.0f} s", flush=True)
    print(json.dumps({"bench": "hf_learning", "model": "qwen3 tiny", "reward": "gsm8k", "steps": args.steps,
                      "prompts": args.prompts, "group": args.group, "lr": args.lr, "warmstart_steps": args.warmstart_steps,
                      "runs": runs, "seeds_over_2se": sum(r["gain_over_2se"] for r in runs)}))


if __name__ == "__main__":
    main()
