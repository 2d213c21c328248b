"""Processes per GPU in the core: a role's node runs one worker per GPU (trainer ranks) or per
``tensor_parallel_size`` GPUs (rollout engines); a GPU's signal is attributed to the worker on it,
and a retired node's workers move together."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.core.events import event
from rlctl.core.launchplan import plan as launch_plan
from rlctl.core.model import JobModel
from rlctl.core.orchestrate import signal_verdict
from rlctl.core.policy import plan
from rlctl.core.spec import SpecError
from rlctl.spec_loader import load_job_file

JOB = """
[job]
name = "pergpu"
[cluster]
backend = "local"
[cluster.local]
nodes = 6
gpus_per_node = {local}
[roles.trainer]
nodes = 2
gpus_per_node = {trainer}
[roles.rollout]
nodes = 1
gpus_per_node = {rollout}
tensor_parallel_size = {tp}
[roles.reward]
nodes = 1
gpus_per_node = 0
[spares]
nodes = 1
warm = false
"""


def spec_of(tmp_path: Path, local: int = 8, trainer: int = 8, rollout: int = 8, tp: int = 2):
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(local=local, trainer=trainer, rollout=rollout, tp=tp))
    return load_job_file(path)


def test_a_node_runs_one_rank_per_gpu_and_one_engine_per_tensor_parallel_group(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    assert (spec.roles["trainer"].workers_per_node, spec.roles["rollout"].workers_per_node,
            spec.roles["reward"].workers_per_node) == (8, 4, 1)
    launch = launch_plan(spec)
    trainer, rollout = launch.roles[0], launch.roles[1]
    assert len(trainer.slots) == 16 and trainer.node_slots(1)["trainer-9"] == [1]
    assert rollout.node_slots(0) == {"rollout-0": [0, 1], "rollout-1": [2, 3], "rollout-2": [4, 5], "rollout-3": [6, 7]}
    # A node without GPUs still runs one worker; the simulator keeps a node as one worker.
    assert launch.roles[2].node_slots(0) == {"reward-0": []}
    assert all(r.workers_per_node == 1 for r in launch.scaled({"trainer": 4, "rollout": 4, "reward": 1}, 1).roles)


def test_a_tensor_parallel_size_that_does_not_divide_the_gpus_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"roles\.rollout\.tensor_parallel_size: expected a divisor"):
        spec_of(tmp_path, tp=3)


def two_rank_node_job() -> JobModel:
    """trainer-0 and trainer-1 on node01 (GPUs 0 and 1), a rollout on node02, an idle spare node03."""
    model = JobModel(job_id="j")
    model.apply(event("JobSubmitted", 1.0, job_id="j", spec_file="x", backend="local", policy="role", steps=10))
    layout = [("node01", "trainer", {"trainer-0": [0], "trainer-1": [1]}), ("node02", "rollout", {"rollout-0": [0]}),
              ("node03", "spare", {})]
    for node, role, slots in layout:
        model.apply(event("NodeAllocated", 1.0, node=node, host="h", role=role, slot=next(iter(slots), ""),
                          slots=slots))
        model.apply(event("AgentRegistered", 1.0, node=node, incarnation=1, facts={}))
        model.apply(event("NodeStateChanged", 1.0, node=node, state="ready", reason="up"))
        model.apply(event("NodeStateChanged", 1.0, node=node, state="standby" if role == "spare" else "active",
                          reason="placed"))
        for slot in slots:
            model.apply(event("WorkerStarting", 1.0, slot=slot, wid=model.next_wid(slot), node=node, role=role))
            model.apply(event("WorkerStarted", 1.0, slot=slot, wid=model.slots[slot].wid, pid=1))
    return model


def test_a_gpu_signal_is_attributed_to_the_worker_on_that_gpu() -> None:
    model = two_rank_node_job()
    assert model.slots["trainer-1"].gpus == (1,)
    verdict = signal_verdict(model, "node01", "xid", 79, "fell off the bus", 5.0, gpu=1)
    assert verdict is not None and verdict.slot == "trainer-1" and "node01 GPU 1" in verdict.reason
    assert signal_verdict(model, "node01", "xid", 79, "", 5.0, gpu=0).slot == "trainer-0"  # type: ignore[union-attr]


def test_a_retired_node_takes_all_its_ranks_to_one_spare_and_the_group_restarts() -> None:
    model = two_rank_node_job()
    verdict = signal_verdict(model, "node01", "xid", 79, "fell off the bus", 5.0, gpu=1)
    assert verdict is not None
    steps = plan(model, verdict, 2)
    moves = [s.journal_fields() for s in steps if s.kind == "move-slot"]
    assert steps[0].kind == "fail-node" and steps[0].journal_fields()["node"] == "node01"
    assert sorted(moves, key=str) == [{"slot": "trainer-0", "node": "node03"}, {"slot": "trainer-1", "node": "node03"}]
    assert sorted(s.journal_fields()["slot"] for s in steps if s.kind == "restart-worker") == ["trainer-0", "trainer-1"]


def test_without_a_spare_one_new_node_is_requested_for_all_the_workers() -> None:
    model = two_rank_node_job()
    model.apply(event("NodeStateChanged", 2.0, node="node03", state="failed", reason="gone"))
    verdict = signal_verdict(model, "node01", "xid", 79, "", 5.0, gpu=0)
    assert verdict is not None
    request = [s.journal_fields() for s in plan(model, verdict, 2) if s.kind == "request-node"]
    assert request == [{"slot": "trainer-0", "slots": ["trainer-0", "trainer-1"], "exclude_node": "node01"}]
