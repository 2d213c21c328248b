"""Two jobs at once on one machine do not interfere: two jobs of the same name under one
``RLCTL_HOME`` and a third under another run side by side; a command that changes a job refuses to
guess which one when several run; a node lost in one job is recovered there while the others'
agents and workers are never touched and their journals hold no fault; each status shows its own
nodes only; each job has its own worker template; and when they have ended, nothing of any of them
is left running. The truth is read from the journals and ``/proc``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlctl.backends.local import AGENT_PID_FILE, AGENT_STATE_FILE
from rlctl.controller.jobdir import JobDir, list_jobs
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    kill_everything_under,
    pid_alive,
    print_figures,
    processes_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    wait_recovered,
    write_job,
)

pytestmark = pytest.mark.slow

STEPS = 40  # long enough that every job still trains when the fault is injected
FAULT_EVENTS = {"FaultInjected", "FaultSignal", "Verdict", "ActionTaken", "FaultRecovered"}


def node_processes(jobdir: JobDir) -> dict[str, set[int]]:
    """Each node's agent and recorded worker pids, from the files the local backend reads."""
    found: dict[str, set[int]] = {}
    for node in sorted((jobdir.path / "nodes").iterdir()):
        pids: set[int] = set()
        try:
            pids.add(int((node / AGENT_PID_FILE).read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        try:
            table = json.loads((node / AGENT_STATE_FILE).read_text())
            workers = table.get("workers", table)
            pids.update(int(w["pid"]) for w in workers.values() if isinstance(w, dict) and w.get("pid"))
        except (OSError, ValueError, AttributeError):
            pass
        found[node.name] = pids
    return found


def template_pids(jobdir: JobDir) -> set[int]:
    templates = set()
    for pid in processes_under(jobdir.path):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"rlctl.worker_template" in cmdline:
            templates.add(pid)
    return templates


@pytest.fixture()
def homes(tmp_path: Path):
    yield tmp_path / "home-one", tmp_path / "home-two"
    kill_everything_under(tmp_path)


def test_two_jobs_under_one_home_and_one_under_another_do_not_touch_each_other(
        tmp_path: Path, homes: tuple[Path, Path]) -> None:
    shared, other = homes
    files = [write_job(tmp_path / folder, name="twin", steps=STEPS, rollouts=1, spares=1, max_restarts=10)
             for folder in ("a", "b", "c")]
    launched = [rlctl_json(home, "launch", str(f)) for home, f in zip((shared, shared, other), files)]
    (job_a, job_b, job_c) = (j["job_id"] for j in launched)
    (dir_a, dir_b, dir_c) = (JobDir(Path(j["job_dir"])) for j in launched)
    assert job_a != job_b and dir_a.path.parent == dir_b.path.parent != dir_c.path.parent
    jobs = ((shared, job_a, dir_a), (shared, job_b, dir_b), (other, job_c, dir_c))
    try:
        for home, job, _ in jobs:
            wait_for(lambda: status(home, job)["job"]["step"] >= 2, 240, f"{job} to train")  # noqa: B023

        guess = rlctl(shared, "inject-fault", "node01", "--kind", "node-down", check=False)
        assert guess.returncode == 2 and job_a in guess.stderr and job_b in guess.stderr and "--job" in guess.stderr, (
            guess, [(j.job_id, j.read_controller()) for j in list_jobs(shared)])

        listed = {j["id"] for j in rlctl_json(shared, "jobs")["jobs"]}
        assert listed == {job_a, job_b}, listed
        templates = {job: template_pids(jobdir) for _, job, jobdir in jobs}
        assert all(templates.values()) and not set.intersection(*templates.values()), templates

        before = {job: node_processes(jobdir) for _, job, jobdir in jobs}
        snap_a = status(shared, job_a)
        lost = next(n["name"] for n in snap_a["nodes"] if n["role"] == "rollout" and n["state"] == "active")
        injected_at = time.monotonic()
        fault = rlctl_json(shared, "inject-fault", lost, "--job", job_a, "--kind", "node-down")
        wait_recovered(shared, job_a, [fault["fault_id"]], snap_a["job"]["step"] + 1, 180, "job A's node to be replaced")
        recovered_s = time.monotonic() - injected_at
        for job in (job_b, job_c):
            untouched = [pid for pids in before[job].values() for pid in pids if not pid_alive(pid)]
            assert not untouched, f"{job}: processes ended by the fault in {job_a}: {untouched}"

        ended = {}
        for home, job, _ in jobs:
            ended[job] = wait_for(lambda: (s := status(home, job)) and s["job"]["state"] in  # noqa: B023
                                  ("succeeded", "failed") and s, 300, f"{job} to end")
    finally:
        for home, job, _ in jobs:
            rlctl(home, "stop", job, check=False)

    for (home, job, jobdir), snap in zip(jobs, ended.values()):
        assert snap["job"]["state"] == "succeeded", (job, snap["job"])
        assert {n["name"] for n in snap["nodes"]} == {p.name for p in (jobdir.path / "nodes").iterdir()}, job
        events = list(Journal(jobdir.journal, readonly=True).read())
        assert [e.data["step"] for e in events if e.type == "StepTrained"] == list(range(STEPS)), job
        if job != job_a:
            assert not [e.type for e in events if e.type in FAULT_EVENTS], job
    events_a = list(Journal(dir_a.journal, readonly=True).read())
    assert any(e.type == "FaultInjected" and e.data["fault_id"] == fault["fault_id"] for e in events_a)

    leftover = wait_for(lambda: not any(processes_under(jobdir.path) for _, _, jobdir in jobs), 30,
                        "every process of the three jobs to end")
    assert leftover
    print_figures("two-jobs", jobs=3, recovered_s=round(recovered_s, 1), steps=STEPS,
                  other_jobs_faults=0, other_jobs_processes_ended=0)
