"""Slurm node loss on the lab: how long until the job has a replacement with weights, and how much
of a Slurm-only recovery would be Slurm's own detection.

Runs the reference job through the Slurm backend on a 6-node ``rlctl lab`` (1 s heartbeats, no
spares), waits for training, then SIGKILLs every process of a rollout node (``inject-fault
--kind node-down``: the lab's machine death) ``--repeats`` times, one node at a time. Per fault,
from the job's journal (times relative to the injection):

* ``rlctl_detect_s``: the ``node-loss`` verdict (heartbeats silent + the backend's probe fails);
* ``replacement_registered_s``: the agent on the new ``--exclude`` allocation registered;
* ``rejoined_with_weights_s``: the replacement rollout serves the weights it pulled over UCX;

and, polled from ``scontrol show node`` at the same time, Slurm's own view of the same fault:

* ``slurm_not_responding_s``: the node is flagged NOT_RESPONDING;
* ``slurm_down_s``: the node is DOWN (what turns a running allocation into NODE_FAIL; the
  lab's ``SlurmdTimeout`` is 10 s, production's default 300 s).

``slurm_only_rejoin_s`` = ``slurm_down_s`` + (``rejoined_with_weights_s`` - ``rlctl_detect_s``):
the same recovery if it had waited for Slurm to declare the node dead.

    sudo .venv/bin/python bench/slurm_recovery.py [--repeats 2]

Needs root (the lab). Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobrun import wait_until

from rlctl import lab
from rlctl.backends.slurm_commands import parse_scontrol_record
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import Event
from rlctl.lab.jobs import reference_job

LAB_NODES = 6
POLL_S = 0.25
SLURM_WATCH_S = 90.0


@dataclass(frozen=True)
class FaultFigures:
    """Seconds from the injection of one node-down to each milestone."""

    node: str
    replacement: str
    rlctl_detect_s: float
    replacement_registered_s: float
    rejoined_with_weights_s: float
    slurm_not_responding_s: float | None
    slurm_down_s: float | None
    slurm_only_rejoin_s: float | None


# --- CLI and journal ----------------------------------------------------------------------------
def cli(home: Path, *args: str, timeout: float = 120.0) -> dict[str, Any]:
    env = {**os.environ, "RLCTL_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli", *args, "--json"], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"rlctl {' '.join(args)} exited {proc.returncode}: {proc.stdout} {proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def events(jobdir: JobDir) -> list[Event]:
    return list(Journal(jobdir.journal, readonly=True).read())


# --- Slurm's own view ---------------------------------------------------------------------------
class SlurmNodeWatch(threading.Thread):
    """Polls ``scontrol show node`` and records when the node is first NOT_RESPONDING and DOWN."""

    def __init__(self, node: str, slurm_conf: Path) -> None:
        super().__init__(daemon=True)
        self.node = node
        self.env = {**os.environ, "SLURM_CONF": str(slurm_conf)}
        self.first_seen: dict[str, float] = {}
        self._stop = threading.Event()

    def run(self) -> None:
        deadline = time.time() + SLURM_WATCH_S
        while not self._stop.is_set() and time.time() < deadline and "DOWN" not in self.first_seen:
            out = subprocess.run(["scontrol", "show", "node", "-o", self.node], env=self.env, capture_output=True,
                                 text=True, check=False, timeout=30).stdout
            state = parse_scontrol_record(out).get("State", "")
            now = time.time()
            for flag in ("NOT_RESPONDING", "DOWN"):
                if flag in state:
                    self.first_seen.setdefault(flag, now)
            self._stop.wait(POLL_S)

    def stop(self) -> None:
        self._stop.set()


# --- one fault ----------------------------------------------------------------------------------
def running_rollout(home: Path, job_id: str) -> tuple[str, str]:
    def find() -> tuple[str, str] | None:
        nodes = cli(home, "status", job_id)["nodes"]
        live = [n for n in nodes if n["role"] == "rollout" and n["worker_state"] == "running" and n["state"] == "active"]
        return (live[0]["name"], live[0]["slot"]) if live else None

    return wait_until("a running rollout", find, 120)


def measure_one(home: Path, job_id: str, jobdir: JobDir, status: lab.LabStatus) -> FaultFigures:
    node, slot = running_rollout(home, job_id)
    watch = SlurmNodeWatch(node, Path(str(status.slurm_conf)))
    watch.start()
    fault_id = cli(home, "inject-fault", node, "--job", job_id, "--kind", "node-down")["fault_id"]
    injected = wait_until("the injection", lambda: next((e for e in events(jobdir) if e.type == "FaultInjected"
                                                         and e.data["fault_id"] == fault_id), None), 30)
    t0 = injected.at

    def rejoined() -> tuple[Event, Event, Event] | None:
        evs = events(jobdir)
        verdict = next((e for e in evs if e.type == "Verdict" and e.data["fault"] == fault_id), None)
        alloc = next((e for e in evs if verdict and e.seq > verdict.seq and e.type == "NodeAllocated"
                      and e.data["slot"] == slot), None)
        if alloc is None:
            return None
        new = alloc.data["node"]
        registered = next((e for e in evs if e.seq > alloc.seq and e.type == "AgentRegistered" and e.data["node"] == new), None)
        held = next((e for e in evs if e.seq > alloc.seq and e.type == "WeightsHeld" and e.data["slot"] == slot
                     and e.data["source"]["host"] == alloc.data["host"] and e.data["version"] > 0), None)
        return (verdict, registered, held) if verdict and registered and held else None

    verdict, registered, held = wait_until(f"a replacement for {node} with weights", rejoined, 240)
    assert held.data["source"]["transport"] == "ucx", held.data
    wait_until(f"Slurm to mark {node} DOWN", lambda: "DOWN" in watch.first_seen or not watch.is_alive(), SLURM_WATCH_S + 5)
    watch.stop()
    detect = verdict.at - t0
    rejoin = held.at - t0
    nr = watch.first_seen.get("NOT_RESPONDING")
    down = watch.first_seen.get("DOWN")
    return FaultFigures(
        node=node, replacement=held.data["source"]["host"],
        rlctl_detect_s=round(detect, 2), replacement_registered_s=round(registered.at - t0, 2),
        rejoined_with_weights_s=round(rejoin, 2),
        slurm_not_responding_s=round(nr - t0, 2) if nr else None,
        slurm_down_s=round(down - t0, 2) if down else None,
        slurm_only_rejoin_s=round(down - t0 + rejoin - detect, 2) if down else None,
    )


# --- main ---------------------------------------------------------------------------------------
def slurmd_timeout(status: lab.LabStatus) -> int:
    out = subprocess.run(["scontrol", "show", "config"], env={**os.environ, "SLURM_CONF": str(status.slurm_conf)},
                         capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("SlurmdTimeout"))
    return int(line.split("=")[1].split()[0])


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="node losses, one after the other (max 2: "
                                                               "6 lab nodes, 4 in the job, one new per loss)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/slurm_recovery.py needs root (it brings up the lab)")
    repeats = max(1, min(args.repeats, LAB_NODES - 4))
    status = lab.up(LAB_NODES, 1)
    for node in status.nodes:
        lab.heal(node.name)
        lab.node_up(node.name)
    from rlctl.lab.slurm import wait_all_idle

    cfg = lab.LabConfig.load(status.state_dir)
    assert cfg is not None
    wait_all_idle(cfg, 120)
    runs: list[FaultFigures] = []
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-slurm-") as tmp:
        home = Path(tmp) / "jobs"
        job_file = Path(tmp) / "job.toml"
        job_file.write_text(reference_job("slurm", status, work_dir=Path(tmp) / "nodes",
                                          cache_dir=ROOT / ".cache" / "rlctl", name="benchslurm"))
        launched = cli(home, "launch", str(job_file))
        job_id, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
        try:
            wait_until("training", lambda: cli(home, "status", job_id)["job"]["step"] >= 2, 240)
            for _ in range(repeats):
                runs.append(measure_one(home, job_id, jobdir, status))
                print(f"  {runs[-1]}", flush=True)
        finally:
            cli(home, "stop", job_id)
            for node in status.nodes:
                lab.heal(node.name)
                lab.node_up(node.name)
    _report(runs, slurmd_timeout(status))


def _report(runs: list[FaultFigures], slurmd_timeout_s: int) -> None:
    keys = ["rlctl_detect_s", "replacement_registered_s", "rejoined_with_weights_s", "slurm_not_responding_s",
            "slurm_down_s", "slurm_only_rejoin_s"]
    print(f"\n{'node':<8}" + "".join(f"{k:>26}" for k in keys))
    for run in runs:
        print(f"{run.node:<8}" + "".join(f"{getattr(run, k)!s:>26}" for k in keys))
    med = {k: median([getattr(r, k) for r in runs]) for k in keys}
    print(f"{'median':<8}" + "".join(f"{med[k]!s:>26}" for k in keys))
    print(json.dumps({"bench": "slurm_recovery", "heartbeat_interval_s": 1.0, "slurmd_timeout_s": slurmd_timeout_s,
                      "fault": "node-down (every process of a rollout node SIGKILLed)", "runs": [asdict(r) for r in runs],
                      "median": med}))


if __name__ == "__main__":
    main()
