"""Launch time: `rlctl launch examples/quickstart.toml` to every agent registered, every worker
running and the first RL step, read from the job's journal.

Baseline in the same run: starting the same number of bare Python interpreters that import
nothing (`python -c pass`) one after the other, the floor for starting agent processes.

    python bench/launch_time.py [--repeats 3]

Prints one JSON object on the last stdout line.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.controller.store import Journal


def one_launch(state_dir: Path) -> dict[str, float]:
    env = dict(os.environ, RLCTL_HOME=str(state_dir))
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    started = time.time()
    out = subprocess.run([sys.executable, "-m", "rlctl.cli", "launch", str(ROOT / "examples" / "quickstart.toml"),
                          "--json"], env=env, capture_output=True, text=True, check=True)
    returned = time.time()
    launched = json.loads(out.stdout.strip().splitlines()[-1])
    journal_path = Path(launched["job_dir"]) / "journal.db"
    nodes = int(launched["nodes"])
    deadline = time.time() + 300
    marks: dict[str, float] = {}
    while time.time() < deadline and "first_step" not in marks:
        events = list(Journal(journal_path, readonly=True).read())
        registered = [e.at for e in events if e.type == "AgentRegistered"]
        if len(registered) >= nodes and "agents_registered" not in marks:
            marks["agents_registered"] = max(registered) - started
        running = [e.at for e in events if e.type == "JobStateChanged" and e.data["state"] == "running"]
        if running and "workers_running" not in marks:
            marks["workers_running"] = running[0] - started
        trained = [e.at for e in events if e.type == "StepTrained"]
        if trained:
            marks["first_step"] = trained[0] - started
        time.sleep(0.2)
    subprocess.run([sys.executable, "-m", "rlctl.cli", "stop", launched["job_id"]], env=env, capture_output=True, check=False)
    marks["launch_command_returned"] = returned - started
    return marks


def bare_processes(count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        subprocess.run([sys.executable, "-S", "-c", "pass"], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlctl-launch-") as tmp:
        for index in range(args.repeats):
            marks = one_launch(Path(tmp) / f"r{index}")
            print(f"[launch_time] {marks}", file=sys.stderr, flush=True)
            runs.append(marks)
    median = {key: round(statistics.median(r[key] for r in runs if key in r), 3) for key in runs[0]}
    baseline = bare_processes(5)
    print(json.dumps({"nodes": 5, "median_s": median, "runs": runs,
                      "baseline_5_bare_python_starts_s": round(baseline, 3),
                      "ratio_agents_registered_to_baseline": round(median["agents_registered"] / baseline, 2)}))


if __name__ == "__main__":
    main()
