"""Reward scheduling with a slow verifier: idle rollout workers that help score (``[reward]
helper_backlog``), then those and a spare's warm standby, against the one reward worker alone (the
baseline), in the same run.

Every arm is a real local job (controller, agents, a trainer, two rollout workers, one reward
worker; the third arm adds one spare) on the reference task, same seed and prompts, with a reward function that sleeps
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
from rlctl.lab.reference_jobs import slow_reward_table, write_job


def rlctl(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "rlctl.cli", *args, "--json"], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_arm(workdir: Path, steps: int, verifier_s: float, backlog: int, spares: int) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    job_file = write_job(workdir, name="reward", steps=steps, spares=spares,
                         extra_tables=slow_reward_table(workdir, backlog, seconds=verifier_s))
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
    scored_by: dict[str, int] = {}
    for e in events:
        if e.type == "ScoringDispatched":
            role = str(e.data["slot"]).split("-")[0]
            scored_by[role] = scored_by.get(role, 0) + len(e.data["item_ids"])
    return {"state": state, "steps": len(trained), "step_s_mean": round(statistics.mean(gaps), 3),
            "step_s": [round(g, 3) for g in gaps], "samples_scored_by": scored_by,
            "samples_scored": sum(scored_by.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--verifier-ms", type=float, default=50.0)
    parser.add_argument("--backlog", type=int, default=8)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlctl-reward-bench-") as tmp:
        for arm, backlog, spares in (("one_reward_worker", 0, 0), ("with_rollout_helpers", args.backlog, 0),
                                     ("with_rollout_and_spare_helpers", args.backlog, 1)):
            print(f"[reward_scheduling] {arm} ...", file=sys.stderr, flush=True)
            results[arm] = run_arm(Path(tmp) / arm, args.steps, args.verifier_ms / 1000.0, backlog, spares)
            print(f"[reward_scheduling] {arm}: {results[arm]}", file=sys.stderr, flush=True)
    baseline = results["one_reward_worker"]["step_s_mean"]
    speedups = {arm: round(baseline / r["step_s_mean"], 3) for arm, r in results.items() if arm != "one_reward_worker"}
    print(json.dumps({"config": vars(args), "results": results, "speedup": speedups}))


if __name__ == "__main__":
    main()
