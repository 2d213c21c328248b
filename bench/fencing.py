"""Fencing: a paused controller that wakes after a successor took over exits without touching the job.

On a real local job, each cycle pauses the controller (SIGSTOP), resumes the job with a new
controller, waits until every agent is back with the successor and training goes on, then wakes
the old one (SIGCONT). Measured: seconds from the wake-up to the old controller's exit; what it
did meanwhile (agents' refusals of its commands, its own journal writes: must be none); seconds
until every agent was back with the successor. Baseline in the same run: a controller killed with
SIGKILL and resumed (no predecessor to fence), for the agents' return.

    python bench/fencing.py [--cycles 3]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bad_inputs import cli

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.lab.reference_jobs import write_job


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def snapshot(state: Path, job: str) -> dict[str, Any]:
    return json.loads(cli(state, "status", job, "--json").stdout.splitlines()[-1])


def wait(predicate: Any, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - began


def all_back(state: Path, job: str, pid: int) -> bool:
    snap = snapshot(state, job)
    live = [n for n in snap["nodes"] if n["state"] not in ("released", "failed")]
    return bool(snap["controller"].get("live")) and snap["controller"].get("pid") == pid \
        and all(n["connected"] for n in live)


def refusals_in_agent_logs(jobdir: JobDir) -> int:
    total = 0
    for log in (jobdir.path / "nodes").glob("*/agent.log"):
        total += log.read_text(errors="replace").count("fenced: command from controller epoch")
    return total


def cycle(state: Path, job: str, jobdir: JobDir, pause: bool) -> dict[str, Any]:
    old = int(jobdir.read_controller()["pid"])
    os.kill(old, signal.SIGSTOP if pause else signal.SIGKILL)
    if not pause:
        wait(lambda: not alive(old), 10, "the controller to die")
    resumed_at = time.monotonic()
    result = cli(state, "resume", job, "--json")
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    new = int(json.loads(result.stdout.splitlines()[-1])["controller_pid"])
    wait(lambda: all_back(state, job, new), 180, "every agent back with the successor")
    agents_back_s = time.monotonic() - resumed_at
    step = snapshot(state, job)["job"]["step"]
    wait(lambda: snapshot(state, job)["job"]["step"] >= step + 1, 120, "a step with the successor")
    row: dict[str, Any] = {"predecessor": "paused" if pause else "killed", "agents_back_s": round(agents_back_s, 2)}
    if pause:
        refusals_before = refusals_in_agent_logs(jobdir)
        fenced_before = jobdir.log_file.read_text(errors="replace").count("fenced (epoch")
        os.kill(old, signal.SIGCONT)
        row["wake_to_exit_s"] = round(wait(lambda: not alive(old), 60, "the fenced controller to exit"), 3)
        row["old_commands_refused_by_agents"] = refusals_in_agent_logs(jobdir) - refusals_before
        row["old_logged_fenced"] = jobdir.log_file.read_text(errors="replace").count("fenced (epoch") > fenced_before
    row["job_state_after"] = snapshot(state, job)["job"]["state"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlctl-fence-") as tmp_name:
        tmp = Path(tmp_name)
        state = tmp / "jobs"
        launched = json.loads(cli(state, "launch", str(write_job(tmp, name="fence", steps=2000)), "--json")
                              .stdout.splitlines()[-1])
        job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
        try:
            wait(lambda: snapshot(state, job)["job"]["step"] >= 2, 180, "two RL steps")
            plan = [False] + [True] * args.cycles
            for pause in plan:
                print(f"[fencing] {'paused' if pause else 'killed'} predecessor ...", file=sys.stderr, flush=True)
                row = cycle(state, job, jobdir, pause)
                print(f"[fencing] {row}", file=sys.stderr, flush=True)
                rows.append(row)
            events = list(Journal(jobdir.journal, readonly=True).read())
            epochs = [ev.data.get("epoch") for ev in events if ev.type == "ControllerStarted"]
            stops = [ev for ev in events if ev.type == "JobStateChanged" and ev.data["state"] in ("stopping", "failed")]
        finally:
            cli(state, "stop", job)
    paused = [r for r in rows if r["predecessor"] == "paused"]
    killed = [r for r in rows if r["predecessor"] == "killed"]
    print(json.dumps({
        "cycles": rows,
        "wake_to_exit_s_median": statistics.median(r["wake_to_exit_s"] for r in paused),
        "wake_to_exit_s_max": max(r["wake_to_exit_s"] for r in paused),
        "agents_back_s_paused_median": statistics.median(r["agents_back_s"] for r in paused),
        "agents_back_s_killed_baseline": killed[0]["agents_back_s"],
        "controller_epochs": epochs,
        "journal_stops_or_failures_before_the_end": len(stops),
        "all_cycles_running_after": all(r["job_state_after"] in ("running", "recovering") for r in rows),
    }))


if __name__ == "__main__":
    main()
