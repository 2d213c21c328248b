"""Several workers per node (local backend, 2 simulated GPUs a node): a trainer node runs two ranks
of one group, a rollout node two engines. An XID 79 on the trainer node's GPU 1 is attributed to
the rank on that GPU; the node is retired and both its ranks move to one new node, and the group
steps again. A crash of one engine restarts that engine alone."""

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
def test_a_gpu_fault_moves_the_nodes_ranks_together_and_an_engine_crash_restarts_one_engine(tmp_path: Path) -> None:
    state_dir = tmp_path / "jobs"
    job_file = write_job(tmp_path, name="pergpu", trainers=1, rollouts=1, spares=1, gpus_per_node=2)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 3 and s, 240, "training")
        events = list(Journal(jobdir.journal, readonly=True).read())
        placed = {e.data["node"]: e.data.get("slots", {}) for e in events if e.type == "NodeAllocated"}
        trainer_node = next(node for node, slots in placed.items() if "trainer-0" in slots)
        rollout_node = next(node for node, slots in placed.items() if "rollout-0" in slots)
        assert placed[trainer_node] == {"trainer-0": [0], "trainer-1": [1]}
        assert placed[rollout_node] == {"rollout-0": [0], "rollout-1": [1]}
        assert {e.data["slot"] for e in events if e.type == "WorkerPhase" and e.data["phase"] == "training"} == \
            {"trainer-0", "trainer-1"}, "both ranks of the node train"
        assert {e.data["slot"] for e in events if e.type == "ItemsDispatched"} >= {"rollout-0", "rollout-1"}, \
            "both engines of the node generate"
        trained = [e.data["metrics"] for e in events if e.type == "StepTrained"]
        assert trained and all((m["ranks"], m["sharded"]) == (2.0, 1.0) for m in trained), "one FSDP group of 2 ranks"
        published = [e.data["source"] for e in events if e.type == "WeightsPublished"]
        assert published and all(s.get("sharded") and len(s["shards"]) == 2 for s in published), \
            "each rank serves its own shard (no gather to rank 0)"
        assert {e.data["slot"] for e in events if e.type == "WeightsHeld"} >= {"rollout-0", "rollout-1"}

        crash = rlctl_json(state_dir, "inject-fault", rollout_node, "--job", job, "--kind", "crash",
                           "--worker", "rollout-1")
        wait_recovered(state_dir, job, [crash["fault_id"]], snap["job"]["step"] + 1, 240, "the engine restarted")
        events = list(Journal(jobdir.journal, readonly=True).read())
        verdict = next(e for e in events if e.type == "Verdict" and e.data["fault"] == crash["fault_id"])
        assert verdict.data["slot"] == "rollout-1"
        actions = [(e.data["action"], e.data.get("slot")) for e in events if e.type == "ActionTaken" and e.seq > verdict.seq
                   and crash["fault_id"] in e.data.get("fault_ids", [])]
        assert actions and all(slot == "rollout-1" for _, slot in actions), actions

        step = status(state_dir, job)["job"]["step"]
        xid = rlctl_json(state_dir, "inject-fault", trainer_node, "--job", job, "--kind", "xid", "--code", "79",
                         "--gpu", "1")
        wait_recovered(state_dir, job, [xid["fault_id"]], step + 3, 300, "the trainer group on a new node and 3 steps")
        events = list(Journal(jobdir.journal, readonly=True).read())
        verdict = next(e for e in events if e.type == "Verdict" and e.data["fault"] == xid["fault_id"])
        assert verdict.data["slot"] == "trainer-1" and f"{trainer_node} GPU 1" in verdict.data["reason"]
        moved = {e.data["slot"]: e.data["node"] for e in events if e.seq > verdict.seq and e.type == "ActionTaken"
                 and e.data["action"] == "move-slot"}
        assert set(moved) == {"trainer-0", "trainer-1"} and len(set(moved.values())) == 1, moved
        assert trainer_node not in moved.values()
        training_after = {e.data["slot"] for e in events if e.seq > verdict.seq and e.type == "WorkerPhase"
                          and e.data["phase"] == "training"}
        assert training_after == {"trainer-0", "trainer-1"}
        assert rlctl_json(state_dir, "report", job)["trajectories_lost"] == 0
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
