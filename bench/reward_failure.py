"""A broken reward function on a real local job: how soon it is said, how soon the job gives up,
and what the ETTR ledger makes of the time (issue 30, item 4).

The small reference job runs with a ``[reward]`` function that never returns (``hang``), always
raises (``raise``) or kills its sandbox (``exit``: ``os._exit(1)``), ``timeout_s`` and
``max_consecutive_failures`` as given. Measured from the journal: each failed call's spacing, the
time from the first failure to ``RewardFunctionFailing`` and to the job's failure, and the ledger.
Baseline in the same run: the same journal replayed without the reward-health events (the ledger as
it was before: every second after the first weights productive).

    python bench/reward_failure.py [--kind hang|raise|exit] [--timeout-s 0.5] [--max-failures 16]

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
from rlctl.core.events import Event, EventKind
from rlctl.core.model import JobModel
from rlctl.lab.reference_jobs import write_job

FUNCTIONS = {
    "hang": "import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    time.sleep(3600)\n",
    "raise": "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
             "    raise ValueError('the verifier is broken')\n",
    "exit": "import os\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    os._exit(1)\n",
}
HEALTH_EVENTS = frozenset({EventKind.REWARD_FUNCTION_FAILING, EventKind.REWARD_FUNCTION_RECOVERED})


def rlctl(state_dir: Path, *args: str) -> Any:
    env = {**os.environ, "RLCTL_HOME": str(state_dir)}
    done = subprocess.run([sys.executable, "-m", "rlctl.cli", *args, "--json"], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def ledger(events: list[Event], without: frozenset[EventKind] = frozenset()) -> dict[str, float]:
    model = JobModel(job_id="bench")
    for ev in events:
        if ev.type not in without:
            model.apply(ev)
    seconds = {k: round(v, 2) for k, v in model.ledger.seconds.items() if v > 0}
    return {**seconds, "wall": round(model.ledger.wall, 2), "ettr": round(model.ledger.ettr(), 4)}


def run(kind: str, timeout_s: float, max_failures: int, folder: Path, limit_s: float) -> dict[str, Any]:
    (folder / "broken.py").write_text(FUNCTIONS[kind])
    tables = f'\n[reward]\nfunction = "broken.py:score"\ntimeout_s = {timeout_s}\nmax_consecutive_failures = {max_failures}\n'
    job_file = write_job(folder, name=f"broken-{kind}", steps=20, rollouts=1, spares=0, extra_tables=tables)
    state_dir = folder / "jobs"
    launched = rlctl(state_dir, "launch", str(job_file))
    job_id = launched["job_id"]
    deadline = time.monotonic() + limit_s
    try:
        while (snap := rlctl(state_dir, "status", job_id))["job"]["state"] not in ("failed", "succeeded", "stopped"):
            if time.monotonic() > deadline:
                raise SystemExit(f"the job did not end within {limit_s:g} s: {snap['job']}")
            time.sleep(1.0)
    finally:
        subprocess.run([sys.executable, "-m", "rlctl.cli", "stop", job_id], env={**os.environ, "RLCTL_HOME": str(state_dir)},
                       capture_output=True, timeout=120, check=False)
    events = list(Journal(JobDir(Path(launched["job_dir"])).journal, readonly=True).read())
    failures = [e.at for e in events if e.type == EventKind.REWARD_FUNCTION_FAILED]
    failing = next((e.at for e in events if e.type == EventKind.REWARD_FUNCTION_FAILING), None)
    ended = next(e.at for e in events if e.type == EventKind.JOB_STATE_CHANGED and e.data["state"] == "stopping")
    gaps = [b - a for a, b in itertools.pairwise(failures)]
    return {
        "kind": kind, "timeout_s": timeout_s, "max_consecutive_failures": max_failures,
        "state": snap["job"]["state"], "reason": snap["job"]["state_reason"], "steps": snap["job"]["step"],
        "failed_calls": len(failures),
        "call_spacing_s_median": round(statistics.median(gaps), 3) if gaps else None,
        "first_failure_to_failing_s": round(failing - failures[0], 2) if failing is not None and failures else None,
        "first_failure_to_job_failed_s": round(ended - failures[0], 2) if failures else None,
        "ledger_s": ledger(events), "baseline_ledger_s": ledger(events, HEALTH_EVENTS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(FUNCTIONS), default="hang")
    parser.add_argument("--timeout-s", type=float, default=0.5)
    parser.add_argument("--max-failures", type=int, default=16)
    parser.add_argument("--limit-s", type=float, default=600.0, help="give up on a job that has not ended by then")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlctl-reward-failure-") as folder:
        print(f"running a job whose reward function does: {args.kind}", file=sys.stderr)
        result = run(args.kind, args.timeout_s, args.max_failures, Path(folder), args.limit_s)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
