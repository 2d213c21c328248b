"""Agentic RL with the calculator tool: held-out reward before and after a GRPO run, and rollout
throughput in turns/s, in process and through a real job's env workers.

The policy is a tiny Llama (made here) warm-started on demonstrations of the calculator tool
(``rlctl.workload.calculator_env``: ``<calc>a * b</calc>``, the tool's ``<result>``, ``#### N``),
1,000 steps by default: the copying skill appears between 750 and 1,000 (docs/figures.md).

- In process (``rlctl.workload.agentic_loop``): the held-out reward of the warm-started policy (the
  baseline) and after ``--steps`` GRPO steps over multi-turn episodes against the calculator in its
  sandbox, on ``--held-out`` prompts the run never trains on, 4 samples each at fixed seeds; and
  turns/s while the episodes play (generation plus the environment's answers).
- Through a job (``--job-steps`` > 0): the same model, data and environment as a real local job
  (controller, agents, a trainer, two rollout workers, a reward worker, an env worker); turns/s
  over the rounds' generation windows (round start to batch formed), which adds the controller's
  env-call queue and the env worker between a turn and its answer; and the job's own held-out
  evaluations (`[data] eval_files`).

    python bench/agentic.py [--steps 30] [--held-out 64] [--job-steps 12]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.spec import EnvSpec
from rlctl.lab.reference_jobs import write_job
from rlctl.workload.agentic_loop import AgenticPolicy, evaluate, run_agentic_grpo
from rlctl.workload.calculator_env import calculator_rows, warm_started_calculator_model
from rlctl.workload.datafiles import read_records
from rlctl.workload.gsm8k_layout import write_rows
from rlctl.workload.hf_init import init_checkpoint
from rlctl.workload.loop import LoopConfig, reward_scorer
from rlctl.workload.prompts import tokenize_records
from rlctl.workload.reference import cache_dir
from rlctl.workload.trainer import TrainerConfig

ENV = EnvSpec(class_ref="calculator", max_turns=3, turn_timeout_s=3.0)  # within the job template's stepping bound
MAX_NEW_TOKENS = 64


def log(message: str) -> None:
    print(f"[agentic] {message}", file=sys.stderr, flush=True)


def prepare(root: Path, warmstart_steps: int, held_out: int) -> tuple[Path, Path, Path]:
    source = root / "llama-tiny"
    if not (source / "config.json").is_file():
        init_checkpoint(source, "llama", "tiny", 0)
    warm = warm_started_calculator_model(source, root / f"warm-{warmstart_steps}", steps=warmstart_steps)
    test = write_rows(calculator_rows(held_out, 0, "test"), root / "test.jsonl")
    return warm / "model", warm / "calc.jsonl", test


def in_process(model: Path, train: Path, test: Path, steps: int, held_out: int) -> dict[str, Any]:
    train_prompts = tokenize_records(read_records([train]), model, 1 << 30, "c").prompts
    test_prompts = tokenize_records(read_records([test]), model, 1 << 30, "e").prompts[:held_out]
    config = LoopConfig(steps=steps, prompts_per_step=16, group_size=8, max_new_tokens=MAX_NEW_TOKENS, seed=3)
    agent = AgenticPolicy(model, config, ENV, TrainerConfig(lr=2e-4, warmup_steps=3, betas=(0.9, 0.99)),
                          scorer=reward_scorer("gsm8k"))
    try:
        before, before_per_prompt = evaluate(agent, test_prompts, 4, 11, MAX_NEW_TOKENS)
        log(f"held-out reward of the warm-started policy: {before:.3f}")
        history = run_agentic_grpo(agent, train_prompts, config)
        after, after_per_prompt = evaluate(agent, test_prompts, 4, 11, MAX_NEW_TOKENS)
        log(f"held-out reward after {steps} steps: {after:.3f}")
    finally:
        agent.close()
    diffs = [a - b for a, b in zip(after_per_prompt, before_per_prompt, strict=True)]
    turns, play_s = sum(s.turns for s in history), sum(s.play_seconds for s in history)
    return {"held_out_reward": {"warm_start": round(before, 4), "after_rl": round(after, 4),
                                "gain_std_err": round(statistics.stdev(diffs) / len(diffs) ** 0.5, 4)},
            "train_reward_by_step": [round(s.reward_mean, 3) for s in history],
            "turns_per_episode": round(turns / sum(16 * 8 for _ in history), 3),
            "turns_per_s": round(turns / play_s, 1), "env_errors": sum(s.env_errors for s in history)}


def through_a_job(model: Path, train: Path, test: Path, steps: int, held_out: int, workdir: Path) -> dict[str, Any]:
    tables = f"""
[model]
path = "{model}"
max_response_tokens = {MAX_NEW_TOKENS}

[data]
train_files = ["{train}"]
eval_files = ["{test}"]
eval_every = {steps}
eval_max_prompts = {held_out}

[reward]
function = "gsm8k"
timeout_s = 2.0

[roles.env]
nodes = 1

[env]
class = "calculator"
max_turns = {ENV.max_turns}
turn_timeout_s = {ENV.turn_timeout_s}
"""
    job_file = write_job(workdir, name="agentic", steps=steps, spares=0, extra_tables=tables)
    # The in-process run's batch (16 prompts x 8 samples: a tiny model collapses on the template's
    # 4 x 4 at this learning rate, in process as well); episodes of a few turns do not fit short
    # rounds: plain synchronous batching.
    text = job_file.read_text()
    for old, new in (("batch_prompts = 4\n", "batch_prompts = 16\n"), ("group_size = 4\n", "group_size = 8\n"),
                     ("worker_batch = 16\n", "worker_batch = 64\n"), ("long_batch = 4\n", "long_batch = 16\n"),
                     ("[rollout.tail_batching]\nenabled = true", "[rollout.tail_batching]\nenabled = false")):
        if old not in text:
            raise RuntimeError(f"the job template changed: {old!r} is gone")
        text = text.replace(old, new)
    job_file.write_text(text)
    env = dict(os.environ, RLCTL_HOME=str(workdir / "jobs"))
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))

    def rlctl(*args: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "rlctl.cli", *args, "--json"], env=env, capture_output=True,
                             text=True, check=True, timeout=300)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    launched = rlctl("launch", str(job_file))
    deadline = time.monotonic() + 1200
    while (state := rlctl("status", launched["job_id"])["job"]["state"]) not in ("succeeded", "failed", "stopped"):
        if time.monotonic() > deadline:
            raise RuntimeError("the job did not finish in 20 minutes")
        time.sleep(1.0)
    events = list(Journal(JobDir(Path(launched["job_dir"])).journal, readonly=True).read())
    starts = {e.data["step"]: e.at for e in events if e.type == "RoundStarted"}
    formed = {e.data["step"]: e.at for e in events if e.type == "BatchFormed"}
    windows = [(starts[s], formed[s]) for s in formed if s in starts]
    turns = sum(e.data["env"]["turns"] for e in events if e.type == "TrajectoryStored" and "env" in e.data
                and any(a <= e.at <= b for a, b in windows))
    seconds = sum(b - a for a, b in windows)
    held = [{"version": e.data["version"], "reward_mean": e.data["reward_mean"]} for e in events
            if e.type == "HeldOutScored"]
    log(f"job {state}: {turns} turns in {seconds:.1f} s of generation windows")
    return {"state": state, "steps": len([e for e in events if e.type == "StepTrained"]),
            "turns_per_s": round(turns / seconds, 1) if seconds else 0.0, "held_out": held,
            "env_failures": sum(1 for e in events if e.type == "EnvFailed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--warmstart-steps", type=int, default=1000)
    parser.add_argument("--job-steps", type=int, default=12)
    args = parser.parse_args()
    root = cache_dir() / "bench-agentic"
    root.mkdir(parents=True, exist_ok=True)
    model, train, test = prepare(root, args.warmstart_steps, args.held_out)
    result: dict[str, Any] = {"config": vars(args), "in_process": in_process(model, train, test, args.steps,
                                                                              args.held_out)}
    if args.job_steps > 0:
        with tempfile.TemporaryDirectory(prefix="rlctl-agentic-") as workdir:
            result["job"] = through_a_job(model, train, test, args.job_steps, args.held_out, Path(workdir))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
