"""A warm standby keeps a copy of the trainer's full state: when the trainer dies between
checkpoints, the standby resumes at the last published step and retrains nothing (no time is
re-classified as lost), and training goes on from there."""

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
def test_standby_resumes_the_trainer_from_its_in_memory_copy(tmp_path: Path) -> None:
    state_dir = tmp_path / "jobs"
    # No checkpoint falls due before the fault: without the copy, every step so far is retrained.
    launched = rlctl_json(state_dir, "launch", str(write_job(tmp_path, name="replica", checkpoint_every=1000)))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        def standing_by() -> dict | None:
            s = status(state_dir, job)
            ready = s and s["job"]["step"] >= 4 and any(n["phase"] == "standby" for n in s["nodes"])
            return s if ready else None

        # The standby copies each offer within a poll (0.3 s) once it has loaded: two more steps.
        ready_at = wait_for(standing_by, 240, "four steps and a loaded warm standby")["job"]["step"]
        snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= ready_at + 2 and s, 120,
                        "two more steps with the standby loaded")
        events = list(Journal(jobdir.journal, readonly=True).read())
        assert [e for e in events if e.type == "WeightsPublished" and "state_source" in e.data], "no state offered"
        trainer = next(n["name"] for n in snap["nodes"] if n["role"] == "trainer")
        step_at_fault = snap["job"]["step"]
        fault = rlctl_json(state_dir, "inject-fault", trainer, "--job", job, "--kind", "crash")

        wait_recovered(state_dir, job, [fault["fault_id"]], step_at_fault + 3, 180,
                       "the standby took over and three more steps")
        events = list(Journal(jobdir.journal, readonly=True).read())
        assert not [e for e in events if e.type == "Checkpointed"]
        verdict = next(e for e in events if e.type == "Verdict" and e.data.get("slot") == "trainer-0")
        assert [e for e in events if e.type == "ActionTaken" and e.data["action"] == "activate-standby"
                and e.seq > verdict.seq], "the warm standby takes the trainer over"
        restored = next(e for e in events if e.type == "TrainerRestored" and e.seq > verdict.seq)
        assert restored.data["checkpoint_step"] is None
        assert restored.data["state_step"] is not None and restored.data["state_step"] >= step_at_fault - 1
        # Only steps published after the copy was taken (at most the one in flight) are retrained.
        assert all(s >= restored.data["state_step"] for s in restored.data["replayed_steps"])
        assert len(restored.data["replayed_steps"]) <= 1
        steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
        assert len(steps) == len(set(steps)), "a batch was generated twice (rollout replay)"
        report = rlctl_json(state_dir, "report", job)
        assert report["trajectories_lost"] == 0
        assert report["seconds"]["lost"] < 2.0, report["seconds"]
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
