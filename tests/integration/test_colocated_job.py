"""Colocated placement on a real local job: the engine runs on the trainer's node and GPU and the
two take turns (the engine sleeps while the trainer steps, never generates while it trains); an
engine crash restarts the engine alone; losing the node hands the trainer to the warm standby,
from its copy of the trainer state, and the engine restarts beside it. Every step trains once,
nothing is lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.chaos.test_fault_kinds import recovered
from tests.integration.helpers import kill_everything_under, rlctl_json, status, wait_for, write_job

STEPS = 24
pytestmark = pytest.mark.timeout(600)
ENGINE_AWAKE = {"generating", "weight-sync", "waiting-for-env"}


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def colocated_node(state_dir: Path, job: str) -> tuple[str, dict[str, Any]]:
    def find() -> tuple[str, dict[str, Any]] | None:
        snap = status(state_dir, job)
        names = [n["name"] for n in snap["nodes"] if n["role"] == "trainer" and n["state"] == "active"
                 and n["worker_state"] == "running"]
        return (names[0], snap) if names else None

    return wait_for(find, 60, "a running colocated node")


def overlaps(events: list[Any]) -> list[str]:
    """Moments, in journal order, where a trainer trained while an engine on its node was awake."""
    phase: dict[str, str] = {}
    node_of: dict[str, str] = {}
    role_of: dict[str, str] = {}
    found = []
    for e in events:
        d = e.data
        if e.type == "WorkerStarting":
            node_of[d["slot"]], role_of[d["slot"]] = d["node"], d["role"]
            phase[d["slot"]] = "starting"
        elif e.type == "ActionTaken" and d["action"] == "activate-standby":
            node_of[d["slot"]] = node_of.get(d["standby_slot"], "")
        elif e.type == "WorkerExited":
            phase[d["slot"]] = "exited"
        elif e.type == "WorkerPhase":
            phase[d["slot"]] = d["phase"]
            training = {node_of[s] for s, p in phase.items() if role_of.get(s) == "trainer" and p == "training"}
            awake = {node_of[s] for s, p in phase.items() if role_of.get(s) == "rollout" and p in ENGINE_AWAKE}
            if training & awake:
                found.append(f"{e.at:.2f} {d['slot']} -> {d['phase']}")
    return found


def copied_step(jobdir: JobDir) -> int:
    """The newest step whose trainer state a warm standby holds (``TrainerStateHeld``), -1 for none."""
    held = [int(e.data["step"]) for e in Journal(jobdir.journal, readonly=True).read() if e.type == "TrainerStateHeld"]
    return max(held, default=-1)


def test_a_colocated_job_takes_turns_and_survives_an_engine_crash_and_losing_its_node(tmp_path: Path, state_dir: Path) -> None:
    job_file = write_job(tmp_path, name="colocated", steps=STEPS, rollouts=1, spares=1, max_restarts=20, colocated=True)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= 2, 240, "the job to train")

    node, snap = colocated_node(state_dir, job)
    crash = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "rollout-0")
    found = wait_for(lambda: recovered(state_dir, job, crash["fault_id"]), 120, "the engine crash to be recovered")
    assert found["verdict"] == "worker-crash" and found["action"] == "restart-worker", found
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= snap["job"]["step"] + 1, 120, "training to go on")

    # The node goes down when the standby's copy (made in the background after every step, so about a
    # step behind) is at least as new as the last checkpoint, and the next checkpoint is two steps off.
    def copy_usable() -> bool:
        job_now = status(state_dir, job)["job"]
        return copied_step(jobdir) >= job_now["checkpoint_step"] >= 0 and job_now["step"] <= job_now["checkpoint_step"] + 1

    wait_for(copy_usable, 120, "the warm standby's copy to be as new as the last checkpoint")
    node, snap = colocated_node(state_dir, job)
    lost = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "node-down")
    found = wait_for(lambda: recovered(state_dir, job, lost["fault_id"]), 180, "the colocated node to be recovered")
    assert found["verdict"] == "node-loss" and found["trajectories_lost"] == 0, found
    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    300, "the job to finish")
    assert done["job"]["state"] == "succeeded", done["job"]

    events = list(Journal(jobdir.journal, readonly=True).read())
    assert [e.data["step"] for e in events if e.type == "StepTrained"] == list(range(STEPS))
    actions = [(e.data["action"], e.data.get("slot")) for e in events if e.type == "ActionTaken"
               and lost["fault_id"] in e.data.get("fault_ids", [])]
    assert ("activate-standby", "trainer-0") in actions and ("move-slot", "rollout-0") in actions, actions
    restored = [e.data for e in events if e.type == "TrainerRestored"]
    before_loss = [e for e in events if e.seq < next(x.seq for x in events if x.type == "FaultInjected"
                                                      and x.data["fault_id"] == lost["fault_id"])]
    copy_at_loss = max((int(e.data["step"]) for e in before_loss if e.type == "TrainerStateHeld"), default=-1)
    checkpoint_at_loss = max((int(e.data["step"]) for e in before_loss if e.type == "Checkpointed"), default=-1)
    if copy_at_loss >= checkpoint_at_loss:  # the usual case (waited for above); else a checkpoint landed in between
        assert restored and restored[-1]["state_step"] is not None, "the standby did not resume from its copy of the state"
    else:
        assert restored and restored[-1]["checkpoint_step"] == checkpoint_at_loss, restored[-1]
    final = status(state_dir, job)
    placed = {n["name"]: n for n in final["nodes"]}
    homes = {slot: e.data["node"] for e in events if e.type == "ActionTaken" and e.data["action"] == "move-slot"
             for slot in [e.data["slot"]]}
    assert homes["rollout-0"] != node and placed[homes["rollout-0"]]["role"] == "trainer", "the engine is back beside the trainer"

    sleeps = [e for e in events if e.type == "WorkerPhase" and e.data["slot"] == "rollout-0" and e.data["phase"] == "sleeping"]
    assert len(sleeps) >= STEPS - 1, f"the engine slept {len(sleeps)} times in {STEPS} steps"
    assert not overlaps(events), overlaps(events)[:5]
