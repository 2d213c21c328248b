"""Reward scheduling with a slow verifier: idle rollout workers that help score (``[reward]
helper_backlog``) against the one reward worker alone (the baseline), in the same run.

Both arms are real local jobs (controller, agents, a trainer, two rollout workers, one reward
worker) on the reference task, same seed and prompts, with a reward function that sleeps
``--verifier-ms`` per sample before scoring (a sandboxed code run, a remote judge). Step time is
the mean gap between consecutive ``StepTrained`` events of the journal (the first step, which
includes start-up, is left out).

    python bench/reward_scheduling.py [--steps 6] [--verifier-ms 50] [--backlog 8]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import itertools
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
from rlctl.jobtemplates import write_job

SLOW_REWARD = """import time

from rlctl.workload.rewardfn import task_score


def slow_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return task_score(data_source, solution_str, ground_truth, extra_info)
"""


def rlctl(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "rlctl.cli", *args, "--json"], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_arm(workdir: Path, steps: int, verifier_s: float, backlog: int) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    (workdir / "slow_reward.py").write_text(SLOW_REWARD.format(seconds=verifier_s))
    job_file = write_job(workdir, name="reward", steps=steps, spares=0, extra_tables=(
        f'\n[reward]\nfunction = "slow_reward.py:slow_score"\nhelper_backlog = {backlog}\n'))
    env = dict(os.environ, RLCTL_HOME=str(workdir / "jobs"))
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    launched = rlctl(env, "launch", str(job_file))
    deadline = time.monotonic() + 1200
    while True:
        state = rlctl(env, "status", launched["job_id"])["job"]["state"]
        if state in ("succeeded", "failed", "stopped"):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the job did not finish in 20 minutes")
        time.sleep(1.0)
    events = list(Journal(JobDir(Path(launched["job_dir"])).journal, readonly=True).read())
    trained = [e.at for e in events if e.type == "StepTrained"]
    gaps = [b - a for a, b in itertools.pairwise(trained)]
    helpers = sum(len(e.data["item_ids"]) for e in events
                  if e.type == "ScoringDispatched" and str(e.data["slot"]).startswith("rollout"))
    scored = sum(len(e.data["item_ids"]) for e in events if e.type == "ScoringDispatched")
    return {"state": state, "steps": len(trained), "step_s_mean": round(statistics.mean(gaps), 3),
            "step_s": [round(g, 3) for g in gaps], "samples_scored_by_rollout_workers": helpers,
            "samples_scored": scored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--verifier-ms", type=float, default=50.0)
    parser.add_argument("--backlog", type=int, default=8)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlctl-reward-bench-") as tmp:
        for arm, backlog in (("one_reward_worker", 0), ("with_rollout_helpers", args.backlog)):
            print(f"[reward_scheduling] {arm} ...", file=sys.stderr, flush=True)
            results[arm] = run_arm(Path(tmp) / arm, args.steps, args.verifier_ms / 1000.0, backlog)
            print(f"[reward_scheduling] {arm}: {results[arm]}", file=sys.stderr, flush=True)
    baseline, helped = results["one_reward_worker"]["step_s_mean"], results["with_rollout_helpers"]["step_s_mean"]
    print(json.dumps({"config": vars(args), "results": results, "speedup": round(baseline / helped, 3)}))


if __name__ == "__main__":
    main()
