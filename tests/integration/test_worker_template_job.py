"""A real local job with the worker template (the default) and the reward role opted out: the
job's virtual nodes share one template, from which the first workers are already forked; a
crashed rollout worker and a crashed trainer are forked again, each reporting its first phase
within a second of the start; the opted-out reward worker is spawned, first and again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import kill_everything_under, rlctl, rlctl_json, status, wait_for, write_job

FORKED = re.compile(r"started worker (\S+) \(role (\w+),.*forked from the template")
READY = re.compile(r"worker template ready \(pid (\d+),")
SPAWNED = re.compile(r"started worker (\S+) \(role (\w+),.*pid \d+$")


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def agent_starts(jobdir: JobDir) -> dict[str, bool]:
    """wid → forked (True) or spawned (False), from every node's agent log."""
    starts: dict[str, bool] = {}
    for log in (jobdir.path / "nodes").glob("*/agent.log"):
        for line in log.read_text(errors="replace").splitlines():
            if (forked := FORKED.search(line)) is not None:
                starts[forked.group(1)] = True
            elif (spawned := SPAWNED.search(line)) is not None:
                starts[spawned.group(1)] = False
    return starts


def template_ready_on(jobdir: JobDir, node: str) -> bool:
    log = jobdir.path / "nodes" / node / "agent.log"
    return log.exists() and "worker template ready" in log.read_text(errors="replace")


def template_pids(jobdir: JobDir) -> set[int]:
    """The pids of the templates the job's agents connected to."""
    pids = set()
    for log in (jobdir.path / "nodes").glob("*/agent.log"):
        pids.update(int(pid) for pid in READY.findall(log.read_text(errors="replace")))
    return pids


def test_restarted_workers_fork_from_the_template_and_start_fast(tmp_path: Path, state_dir: Path) -> None:
    job_file = write_job(tmp_path, name="tpl", spares=0, max_restarts=5)
    text = job_file.read_text()
    job_file.write_text(text.replace("[roles.reward]\n", "[roles.reward]\nfork_from_template = false\n", 1))
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        wait_for(lambda: status(state_dir, job)["job"]["step"] >= 2, 180, "two RL steps")
        first = agent_starts(jobdir)
        assert first and all(forked is (wid.split("-")[0] != "reward") for wid, forked in first.items()), first
        assert len(template_pids(jobdir)) == 1, "the job's virtual nodes share one template"
        for role in ("rollout", "trainer", "reward"):
            snap = status(state_dir, job)
            node = next(n["name"] for n in snap["nodes"] if n["role"] == role and n["worker_state"] == "running")
            if role != "reward":
                wait_for(lambda: template_ready_on(jobdir, node), 60, f"the template on {node}")  # noqa: B023
            step = snap["job"]["step"]
            injected = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash")
            wait_for(lambda: any(f["fault_id"] == injected["fault_id"] and f["recovered_at"]  # noqa: B023
                                 for f in status(state_dir, job)["faults"]), 90, f"{role} recovery")
            wait_for(lambda: status(state_dir, job)["job"]["step"] > step, 90, f"training after the {role} crash")  # noqa: B023
    finally:
        rlctl(state_dir, "stop", job, check=False)
    starts = agent_starts(jobdir)
    events = list(Journal(jobdir.journal, readonly=True).read(types=("WorkerStarting", "WorkerPhase")))
    starting = {e.data["wid"]: (e.data["role"], e.at) for e in events if e.type == "WorkerStarting"}
    first_phase: dict[str, float] = {}
    for event in events:
        if event.type == "WorkerPhase":
            first_phase.setdefault(event.data["wid"], event.at)
    restarted = {wid: role for wid, (role, _) in starting.items() if wid not in first}
    assert sorted(restarted.values()) == ["reward", "rollout", "trainer"], restarted
    for wid, role in restarted.items():
        assert starts[wid] is (role != "reward"), f"{role} worker {wid}: forked {starts[wid]}"
        if role != "reward":
            took = first_phase[wid] - starting[wid][1]
            assert took <= 1.0, f"the restarted {role} ran role code {took:.2f} s after its start"
