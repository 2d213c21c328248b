"""Learning on the HF path: GRPO on a tiny Qwen3 with the GSM8K-layout parquet and the built-in
``gsm8k`` reward raises held-out reward, against the same policy before RL (the baseline), per seed.

Per seed, in this process with ``rlctl.workload.loop`` (no controller: the compute the roles run,
end to end):
1. ``rlctl data gsm8k``'s rows (train/test) and ``rlctl model init --arch qwen3 --size tiny``;
2. the supervised warm-start on the train file's reference solutions (``extra_info.answer``);
3. held-out reward before RL: every test prompt x ``--eval-samples`` samples at temperature 1,
   fixed per-sample seeds, scored with ``gsm8k``;
4. ``--steps`` GRPO steps of ``--prompts`` train prompts x ``--group`` samples (on-policy: the
   engine loads every new version), scored with ``gsm8k``;
5. held-out reward after RL with the same seeds. The difference is paired per prompt; its
   standard error is over prompts.

    python bench/hf_learning.py [--seeds 0 1 2] [--steps 80] [--warmstart-steps 300] [--lr 1e-4]

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

from rlctl.workload.datafiles import read_records
from rlctl.workload.gsm8k_layout import write_dataset
from rlctl.workload.hf_init import init_checkpoint
from rlctl.workload.hf_warmstart import HFWarmStartConfig, train
from rlctl.workload.loop import LoopConfig, reward_scorer, run_grpo
from rlctl.workload.prompts import tokenize_records
from rlctl.workload.trainer import TrainerConfig


def run_seed(seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    data = write_dataset(work / "data", args.train_rows, args.test_rows, seed)
    base = init_checkpoint(work / "base", "qwen3", "tiny", seed)
    warm = work / "warm"
    warm_figures = train(base, warm, data["train"], seed, HFWarmStartConfig(steps=args.warmstart_steps))
    train_prompts = tokenize_records(read_records([data["train"]]), warm, 1024).prompts
    random.Random(seed).shuffle(train_prompts)
    test_prompts = tokenize_records(read_records([data["test"]]), warm, 1024, "e").prompts
    config = LoopConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
                        max_new_tokens=args.max_new, seed=seed)
    result = run_grpo(warm, train_prompts, config, TrainerConfig(lr=args.lr, warmup_steps=2), eval_prompts=test_prompts,
                      eval_samples_per_prompt=args.eval_samples, scorer=reward_scorer("gsm8k"))
    before, after = result.eval_before_per_prompt, result.eval_after_per_prompt
    train_rewards = [record.reward_mean for record in result.history]
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
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--warmstart-steps", type=int, default=300)
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=8)
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
