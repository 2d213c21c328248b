"""Two data-parallel trainer ranks (gloo) in one local job: rank 0 alone publishes and checkpoints,
both train every step; a crashed rank restarts the whole group, which meets again at the
rendezvous and restores from the checkpoint plus the retained batches (no rollout replay)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    kill_everything_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    wait_recovered,
    write_job,
)


@pytest.mark.slow
def test_two_trainer_ranks_train_together_and_restart_together(tmp_path: Path) -> None:
    state_dir = tmp_path / "jobs"
    launched = rlctl_json(state_dir, "launch", str(write_job(tmp_path, name="dp", trainers=2, rollouts=1, spares=1)))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 4 and s, 240, "training")
        events = list(Journal(jobdir.journal, readonly=True).read())
        trainers = {e.data["slot"]: e.data["node"] for e in events if e.type == "NodeAllocated"
                    and e.data["slot"].startswith("trainer-")}
        assert sorted(trainers) == ["trainer-0", "trainer-1"]
        published = {e.data["slot"] for e in events if e.type == "WeightsPublished"}
        assert published == {"trainer-0"}, "only rank 0 publishes weights"
        assert {e.data["slot"] for e in events if e.type == "WorkerPhase" and e.data["phase"] == "training"} == \
            {"trainer-0", "trainer-1"}, "both ranks train"

        fault = rlctl_json(state_dir, "inject-fault", trainers["trainer-1"], "--job", job, "--kind", "crash")
        step_at_fault = snap["job"]["step"]

        wait_recovered(state_dir, job, [fault["fault_id"]], step_at_fault + 3, 240,
                       "the trainer group restarted and three more steps")
        events = list(Journal(jobdir.journal, readonly=True).read())
        verdict = next(e for e in events if e.type == "Verdict" and e.data.get("slot") == "trainer-1")
        restarted = [e.data["slot"] for e in events[events.index(verdict):]
                     if e.type == "ActionTaken" and e.data["action"] == "restart-worker"]
        assert {"trainer-0", "trainer-1"} <= set(restarted), "the whole group restarts"
        assert [e for e in events if e.type == "TrainerRestored" and e.seq > verdict.seq]
        steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
        assert len(steps) == len(set(steps)), "a batch was generated twice (rollout replay)"
        assert {e.data["slot"] for e in events if e.type == "WeightsPublished"} == {"trainer-0"}
        assert not [e for e in events if "state_source" in e.data], "a rank's state alone cannot resume the group"
        assert rlctl_json(state_dir, "report", job)["trajectories_lost"] == 0
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
