"""A trainer and a rollout failing together both recover; rollouts are never replayed for a
trainer failure (the journal shows no rollback and no batch formed twice)."""

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
def test_trainer_and_rollout_fail_together(tmp_path: Path) -> None:
    state_dir = tmp_path / "jobs"
    launched = rlctl_json(state_dir, "launch", str(write_job(tmp_path, name="double", spares=2)))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 4 and s, 180, "training")
        trainer = next(n["name"] for n in snap["nodes"] if n["role"] == "trainer")
        rollout = next(n["name"] for n in snap["nodes"] if n["role"] == "rollout")
        first = rlctl_json(state_dir, "inject-fault", trainer, "--job", job, "--kind", "crash")
        second = rlctl_json(state_dir, "inject-fault", rollout, "--job", job, "--kind", "node-down")
        step_at_fault = snap["job"]["step"]

        final = wait_recovered(state_dir, job, [first["fault_id"], second["fault_id"]], step_at_fault + 3, 120,
                               "both faults recovered and three more steps")
        assert final["job"]["state"] in ("running", "recovering")
        events = list(Journal(jobdir.journal, readonly=True).read())
        assert not [e for e in events if e.type == "SchedulerRolledBack"]
        steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
        assert len(steps) == len(set(steps)), "a batch was generated twice (rollout replay)"
        restored = [e for e in events if e.type == "TrainerRestored"]
        assert restored, "the standby never restored the trainer"
        report = rlctl_json(state_dir, "report", job)
        assert report["trajectories_lost"] == 0
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
