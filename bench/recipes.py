"""Each recipe a verl user brings learns: GRPO with a low_var_kl loss, Dr. GRPO, DAPO, GSPO, RLOO and
REINFORCE++, on the same reference task, model, seeds and steps, each against the same policy before
RL.

Per seed, every recipe starts from the quickstart's reference model (a tiny Llama made and
warm-started here, cached in ``$RLCTL_CACHE``) and trains ``--steps`` RL steps of ``--batch``
prompts x ``--group`` samples of the reference task (add and spell, answers up to 24 characters),
in one process with the job's own parts: the controller's round scheduler (synchronous rounds;
DAPO's dynamic sampling and overlong shaping as its ``[algorithm]`` sets them), the torch engine,
the ``task`` reward function and the trainer with the recipe (``rlctl.workload.scheduled_loop``).
The held-out reward is the mean over ``--eval-prompts`` prompts never trained on, ``--eval-samples``
samples each at temperature 1 with fixed seeds, before and after; the gain is paired per prompt.

``held_out_gain`` is the mean of the seeds' gains and ``held_out_gain_se`` its standard error over
the seeds (the unit that is repeated is a training run); a recipe learns when its gain exceeds two
of them. ``extra_generation`` is the samples generated beyond those trained, as a fraction of
those trained (dynamic sampling's refills).

    python bench/recipes.py [--seeds 0 1 2] [--steps 48] [--lr 1e-4] [--recipes grpo,dapo] [--device cpu]

Prints one line per run to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig
from rlctl.roles.rollout import CHUNK_TOKENS
from rlctl.spec_loader import load_job_file
from rlctl.workload.loop import LoopConfig, Policy, evaluate, micro_batches, reward_scorer, task_prompts
from rlctl.workload.reference import ensure_reference_model
from rlctl.workload.scheduled_loop import ScheduledLoop
from rlctl.workload.trainer import TrainerConfig

MIX = {"add": 0.5, "spell": 0.5}
MAX_EXPECTED_LEN = 24


def recipes(batch: int, max_new: int) -> dict[str, AlgorithmSpec]:
    """Each recipe's ``[algorithm]`` as verl's examples set it (examples/grpo_trainer, recipe/dapo,
    the GSPO paper's clip range, verl's RLOO and REINFORCE++ examples)."""
    quarter = max(1, batch // 4)
    return {
        "grpo": AlgorithmSpec(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl"),
        "dr_grpo": AlgorithmSpec(norm_adv_by_std_in_grpo=False, loss_agg_mode="seq-mean-token-sum-norm"),
        "dapo": AlgorithmSpec.from_table({**AlgorithmSpec().to_table(), "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                          "ppo_mini_batch_size": quarter,
                                          "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 0},
                                          "overlong_buffer": {"enable": True, "len": max(1, max_new // 4),
                                                              "penalty_factor": 1.0}}),
        "gspo": AlgorithmSpec(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
                              clip_ratio_high=4e-4, ppo_mini_batch_size=quarter),
        "rloo": AlgorithmSpec(adv_estimator="rloo", use_kl_in_reward=True, kl_coef=0.001),
        "reinforce_plus_plus": AlgorithmSpec(adv_estimator="reinforce_plus_plus", use_kl_loss=True, kl_loss_coef=0.001,
                                             kl_loss_type="mse"),
    }


def run(name: str, algorithm: AlgorithmSpec, seed: int, args: argparse.Namespace, model_dir: Path,
        train: list[PromptRef], held_out: list[PromptRef], before: list[float]) -> dict[str, Any]:
    torch.manual_seed(seed)
    config = SchedulerConfig(batch_prompts=args.batch, group_size=args.group, max_new_tokens=args.max_new,
                             tail_enabled=False, short_max_tokens=max(1, args.max_new // 2), overprovision=0.0,
                             long_batch=args.batch, seed=seed, filter_groups=algorithm.filter_groups,
                             overlong_buffer=algorithm.overlong_buffer)
    scheduler = RoundScheduler(config, train)
    trainer = TrainerConfig(lr=args.lr, warmup_steps=args.warmup, betas=(0.9, 0.99), algorithm=algorithm,
                            max_response_length=args.max_new)
    policy = Policy(model_dir, LoopConfig(temperature=algorithm.rollout.temperature, device=args.device), trainer)
    scorer = reward_scorer("task")
    loop = ScheduledLoop(scheduler, policy, {p.prompt_id: p for p in train}, scorer, args.worker_batch, CHUNK_TOKENS)
    started = time.perf_counter()
    generated = trained = filtered = 0
    rewards: list[float] = []
    for step in range(args.steps):
        scheduler.start_round(step, loop.now)
        record = loop.generate_round(step)
        metrics = loop.train(step)
        generated += record.generated_samples
        trained += metrics["samples"]
        filtered += metrics["filtered"]
        rewards.append(metrics["reward_mean"])
    after = held_out_rewards(policy, held_out, args, seed)
    gains = [a - b for a, b in zip(after, before, strict=True)]
    result = {"recipe": name, "seed": seed, "held_out_before": round(statistics.fmean(before), 4),
              "held_out_after": round(statistics.fmean(after), 4), "held_out_gain": round(statistics.fmean(gains), 4),
              "held_out_gain_se_prompts": round(statistics.stdev(gains) / len(gains) ** 0.5, 4),
              "train_reward_first": round(statistics.fmean(rewards[:4]), 4),
              "train_reward_last": round(statistics.fmean(rewards[-4:]), 4),
              "extra_generation": round(generated / max(1, trained) - 1.0, 4), "groups_filtered": filtered,
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"[recipes] {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def held_out_rewards(policy: Policy, held_out: list[PromptRef], args: argparse.Namespace, seed: int) -> list[float]:
    """Mean reward per held-out prompt: the same prompts, samples and seeds for every recipe."""
    return evaluate(policy, held_out, args.eval_samples, args.max_new, seed + 20_000, reward_scorer("task"),
                    micro_batches(args.worker_batch))[1]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per recipe: the mean gain over the seeds, its standard error over the seeds, and whether it
    exceeds two of them."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == name]
        gains = [r["held_out_gain"] for r in mine]
        mean = statistics.fmean(gains)
        se = statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else float("nan")
        out[name] = {"held_out_gain": round(mean, 4), "held_out_gain_se": round(se, 4), "learns": mean > 2 * se,
                     "extra_generation": round(statistics.fmean(r["extra_generation"] for r in mine), 4),
                     "held_out_before": round(statistics.fmean(r["held_out_before"] for r in mine), 4),
                     "held_out_after": round(statistics.fmean(r["held_out_after"] for r in mine), 4),
                     "per_seed_gain": gains, "seconds": round(sum(r["seconds"] for r in mine), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=MAX_EXPECTED_LEN + 8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dataset", type=int, default=512, help="training prompts per seed")
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--worker-batch", type=int, default=128)
    parser.add_argument("--recipes", default="grpo,dr_grpo,dapo,gspo,rloo,reinforce_plus_plus")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(int(os.environ.get("RLCTL_TORCH_THREADS", "2")))
    table = recipes(args.batch, args.max_new)
    chosen = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in table]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; expected some of {', '.join(table)}")
    model_dir = ensure_reference_model(load_job_file(ROOT / "examples" / "quickstart.toml"))
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for seed in args.seeds:
        train = task_prompts(model_dir, args.dataset, seed, mix=MIX, max_expected_len=MAX_EXPECTED_LEN)
        held_out = task_prompts(model_dir, args.eval_prompts, seed + 10_000, mix=MIX, max_expected_len=MAX_EXPECTED_LEN)
        initial = Policy(model_dir, LoopConfig(device=args.device), TrainerConfig())
        before = held_out_rewards(initial, held_out, args, seed)
        for name in chosen:
            runs.append(run(name, table[name], seed, args, model_dir, train, held_out, before))
    print(json.dumps({"config": vars(args), "model": str(model_dir), "seconds": round(time.perf_counter() - started, 1),
                      "recipes": summary(runs), "runs": runs}))


if __name__ == "__main__":
    main()
