"""Two sharded trainer ranks (FSDP2 over gloo) in one local job: rank 0 alone reports publishing
and checkpointing, both train every step; a crashed rank restarts the whole group, which meets again
at the rendezvous. With the warm standby's replica every rank takes its own part of the last
step's state back from the standby and nothing is retrained; without it the group restores from
the checkpoint plus the retained batches. Never a rollout replay."""

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
@pytest.mark.parametrize("replica", [True, False], ids=["standby-replica", "checkpoint"])
def test_two_trainer_ranks_train_together_and_restart_together(tmp_path: Path, replica: bool) -> None:
    state_dir = tmp_path / "jobs"
    # No checkpoint falls due before the fault when the replica is on: all it restores is the replica.
    job_file = write_job(tmp_path, name="dp", trainers=2, rollouts=1, spares=1, replicate_trainer_state=replica,
                         checkpoint_every=1000 if replica else 3)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        def ready() -> dict | None:
            s = status(state_dir, job)
            held = not replica or any(e.type == "TrainerStateHeld" and e.data["step"] >= 3
                                      for e in Journal(jobdir.journal, readonly=True).read())
            return s if s and s["job"]["step"] >= 4 and held else None

        snap = wait_for(ready, 240, "training" + (" and the standby holding a replica" if replica else ""))
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
        restored = next(e for e in events if e.type == "TrainerRestored" and e.seq > verdict.seq)
        if replica:
            # The newest copy journaled before the restore: one that landed just before the crash may be
            # reported (the standby polls every 0.3 s) after the verdict, and the restore rightly takes it.
            held = [e for e in events if e.type == "TrainerStateHeld" and e.seq < restored.seq]
            assert len(held[-1].data["source"]["shards"]) == 2, "one part per rank"
            assert restored.data["checkpoint_step"] is None and restored.data["state_step"] == held[-1].data["step"]
            assert all(s >= restored.data["state_step"] for s in restored.data["replayed_steps"])
            assert len(restored.data["replayed_steps"]) <= 1, "at most the step in flight is retrained"
        else:
            assert restored.data["state_step"] is None
            assert not [e for e in events if "state_source" in e.data or e.type == "TrainerStateHeld"]
        steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
        assert len(steps) == len(set(steps)), "a batch was generated twice (rollout replay)"
        assert {e.data["slot"] for e in events if e.type == "WeightsPublished"} == {"trainer-0"}
        assert rlctl_json(state_dir, "report", job)["trajectories_lost"] == 0
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
