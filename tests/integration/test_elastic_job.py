"""Elastic rollout parallelism on a real local job: a rollout node of two one-GPU engines regroups
for each long round (the second engine parks, the first rebuilds over both GPUs and loads the
weights it holds), and both go back for the short rounds. A crash of the wide engine mid-round
restarts it alone, and it regroups again; a crash of the parked follower restarts it parked (no
engine on the leader's GPU). Every step trains once, nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.chaos.test_fault_kinds import recovered
from tests.integration.helpers import kill_everything_under, rlctl_json, status, wait_for, write_job

STEPS = 16
pytestmark = pytest.mark.timeout(600)
ELASTIC = """
[rollout.elastic]
enabled = true
policy = "always"
"""


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def resizes(jobdir: JobDir) -> list[tuple[str, int]]:
    return [(e.data["slot"], int(e.data["tensor_parallel"])) for e in Journal(jobdir.journal, readonly=True).read()
            if e.type == "EngineResized"]


def test_long_rounds_regroup_the_engines_and_short_rounds_give_them_back(tmp_path: Path, state_dir: Path) -> None:
    job_file = write_job(tmp_path, name="elastic", steps=STEPS, rollouts=1, spares=0, max_restarts=20,
                         rollout_gpus_per_node=2, extra_tables=ELASTIC)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    wait_for(lambda: ("rollout-0", 2) in resizes(jobdir), 300, "a long round to regroup the engines")

    snap = status(state_dir, job)
    node = next(n["name"] for n in snap["nodes"] if n["role"] == "rollout")
    crash = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "rollout-0")
    found = wait_for(lambda: recovered(state_dir, job, crash["fault_id"]), 120, "the wide engine's crash to be recovered")
    assert found["verdict"] == "worker-crash" and found["action"] == "restart-worker", found

    # The follower crashes while parked: a worker started during a wide round loads no engine (its
    # GPU is the leader's) and says it is parked before it takes any work.
    regroups = resizes(jobdir).count(("rollout-0", 2))
    wait_for(lambda: resizes(jobdir).count(("rollout-0", 2)) > regroups, 300, "the engines to regroup again")
    crash = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "rollout-1")
    found = wait_for(lambda: recovered(state_dir, job, crash["fault_id"]), 120, "the parked follower's crash to be recovered")
    assert found["action"] == "restart-worker", found

    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    420, "the job to finish")
    assert done["job"]["state"] == "succeeded", done["job"]
    events = list(Journal(jobdir.journal, readonly=True).read())
    rounds = [e.data for e in events if e.type == "RoundStarted"]
    wide = [r for r in rounds if r.get("tensor_parallel") == 2]
    assert wide and all(r["kind"] == "long" for r in wide), rounds
    assert all(r.get("tensor_parallel", 0) == 0 for r in rounds if r["kind"] == "short")
    order = resizes(jobdir)
    assert ("rollout-1", 0) in order and ("rollout-1", 1) in order and ("rollout-0", 1) in order, order
    # Every regroup came after the follower parked; every wake after the leader shrank back.
    for index, (slot, degree) in enumerate(order):
        before = order[:index]
        if slot == "rollout-0" and degree == 2:
            assert ("rollout-1", 0) in before, order
    started = [e for e in events if e.type == "EngineResized" and e.data["tensor_parallel"] == 2]
    assert all(e.data["gpus"] == [0, 1] and e.data["seconds"] > 0 for e in started)
    restarted = [e for e in events if e.type == "WorkerStarting" and e.data["slot"] == "rollout-1"][-1]
    first = next((e for e in events if e.seq > restarted.seq and e.data.get("wid") == restarted.data["wid"]
                 and e.type in ("EngineResized", "ItemsDispatched")), None)
    assert first is not None, "the restarted follower never worked again"
    if _wide_round_open(events, restarted.seq):
        assert first.type == "EngineResized" and first.data["tensor_parallel"] == 0 and first.data["seconds"] == 0.0, first
    assert sorted(int(e.data["step"]) for e in events if e.type == "StepTrained") == list(range(STEPS))
    assert all(f["trajectories_lost"] == 0 for f in done["faults"]), done["faults"]


def _wide_round_open(events: list, seq: int) -> bool:
    """Whether the last round started before ``seq`` was a regrouped one and had not closed."""
    opened = [e for e in events if e.seq < seq and e.type == "RoundStarted"]
    if not opened or opened[-1].data.get("tensor_parallel") != 2:
        return False
    return not any(e.type == "BatchFormed" and opened[-1].seq < e.seq < seq for e in events)
