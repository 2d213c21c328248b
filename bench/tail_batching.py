"""Tail batching vs plain synchronous batching, same seed and prompts, real generation and training.

Both arms run the controller's real round scheduler (`rlctl.core.rounds.RoundScheduler`, tail
batching on or off), the real torch generation engine and the real GRPO trainer on the Hugging
Face path (the reference model's shape: a tiny Llama made here, warm-started), in one process,
from the same warm-started model, on the reference task's long-tailed response lengths, prompts
through the chat template and responses decoded and scored by the ``task`` reward function as in
a job. Each
step: the scheduler hands out items in worker-sized batches, the engine generates them (a batch
lasts as long as its longest row), the reward function scores them, the batch trains, the new
weights load. As in a real job, finished samples are stored and scored while the rest of the
batch still decodes (every ``CHUNK_TOKENS`` steps, the rollout worker's poll interval), so a short
round closes as soon as its batch is full and its in-flight extras are cancelled.

After N steps the tail arm settles the prompts still in its long queue in long rounds (unless
``--no-drain``): they are work it deferred, which the synchronous arm paid within its N steps.
The headline ratios are therefore per trained prompt. Measured per arm: rollout-phase seconds,
total seconds, decode steps and generated tokens (all per trained prompt and in total), training
reward (mean over the last steps of the first N), round kinds, and the reward of each arm's final
policy on held-out prompts (the same prompts for both arms and for the initial model, greedy as
verl's ``val_kwargs`` default; ``eval_gain`` is an arm's reward minus the initial model's, paired
per prompt, with its standard error ``eval_gain_se``, and ``eval_reward_delta`` tail minus sync).

    python bench/tail_batching.py [--seed 0] [--steps 32] [--batch 16] [--group 8] [--lr 1e-4] [--max-new 160] [--short-cap 24] [--device cuda]

The defaults are the headline configuration (docs/figures.md): 16 prompts x 8 samples a step for
32 steps at a learning rate of 1e-4 (both arms learn: 3e-4, the earlier default, left both below
the initial policy on held-out prompts), the long answers from the ``down`` family (60% of prompts; a Pareto number of terms, expected length
p50 6, p99 140 tokens), and a 1,500-step warm-start that saw enough long answers to write them
out in full (``--warmstart-length-alpha 0.2``), so the generated lengths keep the task's tail.
Earlier tables used ``--long-family count``: a short warm-start does not teach the small policy
where a count stops, so it mostly stops early and what it generates has little tail.

Besides seconds, each arm counts batched decode steps and generated tokens: on a GPU a decode
step costs about the same at any batch size (memory-bound), so the longest row sets a round's
time; on a CPU a step costs per live row (the engine drops finished rows), so total tokens do.

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.core.algorithm import LOSS_AGG_MODES, AlgorithmSpec
from rlctl.core.rounds import RoundScheduler, SchedulerConfig
from rlctl.roles.rollout import CHUNK_TOKENS
from rlctl.workload.engine import GenRequest, SamplingConfig, TorchEngine
from rlctl.workload.hf_init import init_checkpoint
from rlctl.workload.hf_warmstart import HFWarmStartConfig, prepare_warmstart
from rlctl.workload.loop import LoopConfig, Policy, Scorer, evaluate, micro_batches, reward_scorer, task_prompts
from rlctl.workload.reference import REFERENCE_ARCH, model_size
from rlctl.workload.scheduled_loop import ScheduledLoop
from rlctl.workload.task import DEFAULT_MIX, length_stats, make_dataset
from rlctl.workload.trainer import TrainerConfig


def family_mix(long_share: float | None, long_family: str = "count") -> dict[str, float] | None:
    """The task's family weights with ``long_family`` (the long answers) at ``long_share``; None
    keeps the task's default mix, its ``count`` share given to ``long_family``."""
    if long_share is None:
        return None if long_family == "count" else {long_family if f == "count" else f: w for f, w in DEFAULT_MIX.items()}
    rest = 1.0 - long_share
    return {"add": round(0.4 * rest, 6), "spell": round(0.6 * rest, 6), long_family: long_share}


def rl_mix(args: argparse.Namespace) -> dict[str, float] | None:
    return family_mix(args.count_share, args.long_family)


def held_out_rewards(policy: Policy, model_dir: Path, args: argparse.Namespace, scorer: Scorer) -> list[float]:
    """Mean reward per held-out prompt (``--eval-prompts`` prompts never trained on, the full length
    cap; greedy, verl's ``val_kwargs`` default, or ``--eval-samples`` samples each with fixed
    seeds): the same test for every arm."""
    held_out = task_prompts(model_dir, args.eval_prompts, args.seed + 10_000, mix=rl_mix(args))
    greedy = args.eval_sampling == "greedy"
    sampling = policy.engine.sampling.with_sampling(0.0, 1.0, -1, False) if greedy else None
    return evaluate(policy, held_out, 1 if greedy else args.eval_samples, args.max_new, args.seed + 20_000, scorer,
                    micro_batches(args.worker_batch), sampling)[1]


def run_arm(tail: bool, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    dataset = task_prompts(model_dir, args.dataset, args.seed, mix=rl_mix(args))
    prompts = {p.prompt_id: p for p in dataset}
    scheduler = RoundScheduler(
        SchedulerConfig(batch_prompts=args.batch, group_size=args.group, max_new_tokens=args.max_new,
                        tail_enabled=tail, short_max_tokens=args.short_cap, overprovision=args.overprovision,
                        long_batch=args.batch, seed=args.seed),
        dataset,
    )
    recipe = AlgorithmSpec(loss_agg_mode=args.loss_agg_mode, use_kl_loss=args.kl_loss_coef > 0,
                           kl_loss_coef=args.kl_loss_coef)
    policy = Policy(model_dir, LoopConfig(device=args.device),
                    TrainerConfig(lr=args.lr, warmup_steps=args.warmup, algorithm=recipe, max_response_length=args.max_new))
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    loop = ScheduledLoop(scheduler, policy, prompts, reward_scorer("task"), args.worker_batch, CHUNK_TOKENS,
                         synchronize)
    rollout_s: list[float] = []
    decode_steps = generated_tokens = cancelled = trained_prompts = drain_steps = step = 0
    generated_lengths: list[int] = []
    rewards: list[float] = []
    kinds: list[str] = []
    started = time.perf_counter()
    while True:
        if step < args.steps:
            scheduler.start_round(step, loop.now)
        elif args.drain and scheduler.long_queue:
            # The deferred prompts are work the tail arm still owes: settle it in long rounds
            # (generated and trained like any other) before comparing time per trained prompt.
            scheduler.start_long_round(step, loop.now)
            drain_steps += 1
        else:
            break
        record = loop.generate_round(step)
        metrics = loop.train(step)
        decode_steps += record.decode_steps
        generated_tokens += record.generated_tokens
        cancelled += record.cancelled
        generated_lengths.extend(record.lengths)
        rollout_s.append(record.seconds)
        rewards.append(metrics["reward_mean"])
        kinds.append(metrics["kind"])
        trained_prompts += metrics["prompts"]
        print(f"[tail_batching] {'tail' if tail else 'sync'} step {step} {metrics['kind']} rollout {record.seconds:.2f}s "
              f"reward {metrics['reward_mean']:.3f}", file=sys.stderr, flush=True)
        step += 1
    total = time.perf_counter() - started
    last = max(1, args.steps // 4)
    eval_per_prompt = held_out_rewards(policy, model_dir, args, loop.scorer) if args.eval_prompts else []
    return {
        "eval_reward": round(statistics.fmean(eval_per_prompt), 4) if eval_per_prompt else None,
        "eval_per_prompt": eval_per_prompt,
        "steps": step,
        "drain_steps": drain_steps,
        "trained_prompts": trained_prompts,
        "rollout_s_per_trained_prompt": round(sum(rollout_s) / trained_prompts, 5),
        "decode_steps_per_trained_prompt": round(decode_steps / trained_prompts, 3),
        "generated_tokens_per_trained_prompt": round(generated_tokens / trained_prompts, 3),
        "total_s_per_trained_prompt": round(total / trained_prompts, 5),
        "rollout_s_per_step_mean": round(statistics.fmean(rollout_s), 3),
        "rollout_s_per_step_median": round(statistics.median(rollout_s), 3),
        "rollout_s_total": round(sum(rollout_s), 2),
        "total_s": round(total, 2),
        "final_reward": round(statistics.fmean(rewards[-last:]), 4),
        "first_reward": round(statistics.fmean(rewards[:last]), 4),
        "rounds": {k: kinds.count(k) for k in sorted(set(kinds))},
        "generated_length": _length_summary(generated_lengths),
        "decode_steps_total": decode_steps,
        "generated_tokens_total": generated_tokens,
        "samples_cancelled": cancelled,
    }


def decode_cost_probe(model_dir: Path, device: str, sizes: tuple[int, ...] = (1, 8, 32, 128),
                      tokens: int = 32) -> dict[str, float]:
    """Milliseconds per batched decode step at several batch sizes, rows never stopping early (best
    of 3): whether this device pays per step (flat) or per live row (growing)."""
    from rlctl.workload.hf_model import load_hf_policy

    engine = TorchEngine(load_hf_policy(model_dir, device), SamplingConfig(temperature=1.0, eos_id=-1), device=device)
    prompt = list(task_prompts(model_dir, 1, 0)[0].tokens)
    engine.generate([GenRequest("warm", prompt, 0)], 4)
    costs: dict[str, float] = {}
    for size in sizes:
        requests = [GenRequest(f"probe-{i}", prompt, i) for i in range(size)]
        best = float("inf")
        for _ in range(3):
            engine.generate(requests, tokens)
            best = min(best, engine.last_stats.seconds)
        costs[str(size)] = round(best / tokens * 1000, 3)
    return costs


def initial_model(seed: int, warm: HFWarmStartConfig) -> Path:
    """The warm-started model both arms start from, cached in ``$RLCTL_CACHE``: the reference
    model's shape (``[workload]`` defaults) made with ``seed``, then ``warm``'s supervised steps."""
    cache = Path(os.environ.get("RLCTL_CACHE", os.path.expanduser("~/.cache/rlctl")))
    cache.mkdir(parents=True, exist_ok=True)
    base = cache / f"tail-bench-{REFERENCE_ARCH}-base-s{seed}"
    if not (base / "config.json").is_file():
        staging = base.with_name(f".{base.name}.tmp-{os.getpid()}")
        init_checkpoint(staging, REFERENCE_ARCH, model_size(128, 4, 2), seed)
        os.replace(staging, base)
    return prepare_warmstart(base, cache / f"tail-bench-{REFERENCE_ARCH}-warm-s{seed}", None, seed, warm)


def paired_difference(first: list[float], second: list[float]) -> tuple[float, float]:
    """Mean of ``first[i] - second[i]`` and its standard error (same prompts, same seeds)."""
    if len(first) < 2:
        return 0.0, 0.0
    differences = [a - b for a, b in zip(first, second)]
    return round(statistics.fmean(differences), 4), round(statistics.stdev(differences) / len(differences) ** 0.5, 4)


def _length_summary(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths) or [0]
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "max": ordered[-1], "n": len(lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--worker-batch", type=int, default=192)
    parser.add_argument("--max-new", type=int, default=160)
    parser.add_argument("--short-cap", type=int, default=24)
    parser.add_argument("--overprovision", type=float, default=0.5)
    parser.add_argument("--dataset", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=0, help="learning-rate warmup steps")
    parser.add_argument("--loss-agg-mode", choices=LOSS_AGG_MODES, default="token-mean",
                        help="[algorithm] loss_agg_mode of both arms")
    parser.add_argument("--kl-loss-coef", type=float, default=0.0, help="a low_var_kl loss to the initial policy (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=1024,
                        help="held-out prompts scored after training, for both arms and the initial model (0: none)")
    parser.add_argument("--eval-sampling", choices=("greedy", "sampled"), default="greedy",
                        help="held-out responses: greedy (verl's val_kwargs default) or sampled at temperature 1")
    parser.add_argument("--eval-samples", type=int, default=4, help="with --eval-sampling sampled: samples a prompt")
    parser.add_argument("--no-drain", dest="drain", action="store_false",
                        help="stop the tail arm after --steps even with prompts left in its long queue")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--warmstart-steps", type=int, default=1500,
                        help="supervised steps before RL; fewer leave a policy whose answers run long more often")
    parser.add_argument("--long-family", choices=("count", "down"), default="down",
                        help="the task family that supplies the long answers: 'count' (the policy must learn "
                             "where to stop, and a short warm-start stops early) or 'down' (stops at 0, so the "
                             "policy writes the task's long tail)")
    parser.add_argument("--count-share", type=float, default=0.6,
                        help="share of the long-answer family in the RL prompts (negative: the task's mix)")
    parser.add_argument("--warmstart-count-share", type=float, default=0.6,
                        help="share of the long-answer family in the warm-start data (negative: the task's mix)")
    parser.add_argument("--warmstart-length-alpha", type=float, default=0.2,
                        help="Pareto shape of the long answers in the warm-start data (smaller: more long "
                             "examples to learn from; 0: the task's)")
    args = parser.parse_args()
    for share in ("count_share", "warmstart_count_share"):
        if getattr(args, share) < 0:
            setattr(args, share, None)
        elif getattr(args, share) > 1:
            parser.error(f"--{share.replace('_', '-')} must be at most 1, got {getattr(args, share)}")
    if args.warmstart_length_alpha < 0:
        parser.error(f"--warmstart-length-alpha must be >= 0, got {args.warmstart_length_alpha}")
    args.warmstart_length_alpha = args.warmstart_length_alpha or None
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(int(os.environ.get("RLCTL_TORCH_THREADS", "2")))
    warm = HFWarmStartConfig(steps=args.warmstart_steps, mix=family_mix(args.warmstart_count_share, args.long_family),
                             length_alpha=args.warmstart_length_alpha)
    model_dir = initial_model(args.seed, warm)
    stats = length_stats(make_dataset(args.dataset, args.seed, mix=rl_mix(args)))  # expected lengths; generated ones per arm below
    decode_cost = decode_cost_probe(model_dir, args.device)
    print(f"[tail_batching] decode ms per step by batch size: {decode_cost}", file=sys.stderr, flush=True)
    sync = run_arm(False, args, model_dir)
    tail = run_arm(True, args, model_dir)
    initial_eval: list[float] = []
    if args.eval_prompts:
        initial = Policy(model_dir, LoopConfig(device=args.device), TrainerConfig(lr=args.lr))
        initial_eval = held_out_rewards(initial, model_dir, args, reward_scorer("task"))
    tail_eval, sync_eval = tail.pop("eval_per_prompt"), sync.pop("eval_per_prompt")
    eval_delta, eval_delta_se = paired_difference(tail_eval, sync_eval)
    for arm, per_prompt in ((sync, sync_eval), (tail, tail_eval)):
        # Each arm's held-out reward after training minus the initial model's: paired per prompt.
        arm["eval_gain"], arm["eval_gain_se"] = paired_difference(per_prompt, initial_eval)
    print(json.dumps({
        "config": vars(args),
        "response_length_stats": stats,
        "sync": sync,
        "tail_batching": tail,
        # Per trained prompt, the tail arm's deferred prompts settled in long rounds (--drain): the
        # comparable figures. The first-N-steps ratios leave the tail arm's deferred work out.
        "rollout_speedup": round(sync["rollout_s_per_trained_prompt"] / max(tail["rollout_s_per_trained_prompt"], 1e-9), 3),
        "end_to_end_speedup": round(sync["total_s_per_trained_prompt"] / max(tail["total_s_per_trained_prompt"], 1e-9), 3),
        "decode_step_ratio": round(sync["decode_steps_per_trained_prompt"]
                                   / max(tail["decode_steps_per_trained_prompt"], 1e-9), 3),
        # Training reward of the last steps depends on which prompts a step drew (tail batching
        # trains its long prompts in separate rounds); the held-out evaluation does not.
        "final_reward_delta": round(tail["final_reward"] - sync["final_reward"], 4),
        "eval_reward_initial": round(statistics.fmean(initial_eval), 4) if initial_eval else None,
        "eval_reward_delta": eval_delta,
        "eval_reward_delta_se": eval_delta_se,
        "eval_within_noise": abs(eval_delta) <= 2 * eval_delta_se if initial_eval else None,
        # Batched decode steps set rollout time where a step costs about the same at any batch size
        # (a GPU's memory-bound decode); generated tokens set it where a step costs per live row
        # (this CPU). Both counted, not modelled.
        "generated_token_ratio": round(sync["generated_tokens_per_trained_prompt"]
                                       / max(tail["generated_tokens_per_trained_prompt"], 1e-9), 3),
        "device": args.device,
        "decode_ms_per_step_by_batch": decode_cost,
        "target": "rollout phase >= 2x faster, final reward within noise",
    }))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
