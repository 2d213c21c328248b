"""Colocated placement in the core: the spec's rules, engines placed on the trainer's nodes and
GPUs, the turn-taking gates, weights from the holder on the same node, and the recovery of a
lost colocated node (the warm standby takes the trainer, the engines restart beside it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.core.colocation import engine_may_generate, trainer_may_step
from rlctl.core.effects import NodeGrant
from rlctl.core.events import event
from rlctl.core.launchplan import plan as launch_plan
from rlctl.core.model import JobModel
from rlctl.core.policy import plan
from rlctl.core.spec import SpecError
from rlctl.spec_loader import load_job_file
from tests.core.test_orchestrate import orchestrator
from tests.core.test_policy import kinds, verdict
from tests.core.test_rounds import make_scheduler

JOB = """
[job]
name = "colo"
[cluster]
backend = "local"
[cluster.local]
gpus_per_node = 2
[roles.trainer]
nodes = {trainer}
gpus_per_node = 2
[roles.rollout]
nodes = {rollout}
gpus_per_node = {rollout_gpus}
tensor_parallel_size = 2
placement = "colocated"
[roles.reward]
nodes = 1
gpus_per_node = 0
[trainer]
stream = {stream}
[spares]
nodes = 1
"""


def spec_of(tmp_path: Path, trainer: int = 2, rollout: int = 2, rollout_gpus: int = 2, stream: bool = False):
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(trainer=trainer, rollout=rollout, rollout_gpus=rollout_gpus, stream=str(stream).lower()))
    return load_job_file(path)


def test_colocated_engines_allocate_no_nodes_and_share_the_trainer_gpus(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    assert spec.colocated and spec.nodes_needed == 2 + 1 + 1  # trainer nodes, the reward node, the spare
    launch = launch_plan(spec)
    assert launch.nodes_by_role == {"trainer": 2, "reward": 1, "env": 0}
    assert launch.allocation("j").gpus_per_node == {"trainer": 2, "reward": 0, "env": 1}
    assert "colocated on the trainer nodes" in launch.lines()[1]

    orc, shell = orchestrator()
    grants = [NodeGrant(f"n{i}", "127.0.0.1", "") for i in range(4)]
    orc.place(grants, launch.roles, warm_spares=True)
    placed = {e.data["node"]: e.data for e in shell.journal if e.type == "NodeAllocated"}
    assert placed["n0"]["slots"] == {"trainer-0": [0], "trainer-1": [1], "rollout-0": [0, 1]}
    assert placed["n1"]["slots"] == {"trainer-2": [0], "trainer-3": [1], "rollout-1": [0, 1]}
    assert placed["n0"]["slot_roles"]["rollout-0"] == "rollout" and placed["n2"]["role"] == "reward"
    assert shell.model.slots["rollout-1"].role == "rollout" and shell.model.slots["rollout-1"].node == "n1"


@pytest.mark.parametrize("kwargs, key", [
    ({"rollout": 1}, "roles.rollout.nodes: expected 2 (roles.trainer.nodes)"),
    ({"rollout_gpus": 4}, "roles.rollout.gpus_per_node: expected 2"),
    ({"stream": True}, "trainer.stream: expected false"),
])
def test_impossible_colocations_are_refused_by_key(tmp_path: Path, kwargs: dict, key: str) -> None:
    with pytest.raises(SpecError, match=key.replace("(", r"\(").replace(")", r"\)")):
        spec_of(tmp_path, **kwargs)


def colocated_job(standby_phase: str = "standby") -> JobModel:
    """node01: trainer-0 and rollout-0 on the same GPU; node02: the reward worker; node05: a spare."""
    model = JobModel(job_id="j")
    model.apply(event("JobSubmitted", 1.0, job_id="j", spec_file="x", backend="local", policy="role", steps=10))
    layout = [("node01", "trainer", {"trainer-0": [0], "rollout-0": [0]}, False),
              ("node02", "reward", {"reward-0": []}, False), ("node05", "spare", {"standby-0": []}, True)]
    for node, role, slots, standby in layout:
        model.apply(event("NodeAllocated", 1.0, node=node, host="h", role=role, slot=next(iter(slots)), slots=slots,
                          slot_roles={s: s.split("-")[0] for s in slots} if not standby else None,
                          standby=standby, role_of_slot="trainer" if standby else role))
        model.apply(event("AgentRegistered", 1.0, node=node, incarnation=1, facts={}))
        for state in ("ready", "standby" if standby else "active"):
            model.apply(event("NodeStateChanged", 1.0, node=node, state=state, reason="up"))
        for slot in slots:
            model.apply(event("WorkerStarting", 1.0, slot=slot, wid=model.next_wid(slot), node=node,
                              role="trainer" if standby else slot.split("-")[0], standby=standby))
            model.apply(event("WorkerStarted", 1.0, slot=slot, wid=model.slots[slot].wid, pid=1))
    model.apply(event("WorkerPhase", 1.0, slot="standby-0", wid=model.slots["standby-0"].wid, phase=standby_phase, step=0))
    return model


def phase(model: JobModel, slot: str, name: str) -> None:
    model.apply(event("WorkerPhase", 2.0, slot=slot, wid=model.slots[slot].wid, phase=name, step=0))


def test_the_trainer_steps_only_once_the_engine_beside_it_sleeps_and_the_engine_waits_out_the_step() -> None:
    model = colocated_job()
    scheduler = make_scheduler(tail=False, batch=2, group=2)
    scheduler.start_round(0, 1.0)
    trainer, engine = model.slots["trainer-0"], model.slots["rollout-0"]
    for name, may_step in (("generating", False), ("waiting-for-work", False), ("weight-sync", False),
                           ("sleeping", True), ("scoring", True)):
        phase(model, "rollout-0", name)
        assert trainer_may_step(model, scheduler, trainer) is may_step, name
    scheduler.dispatch("rollout-0", engine.wid or "", 2, 2.0)
    assert not trainer_may_step(model, scheduler, trainer), "handed work, not yet generating: about to wake"
    for name, may_generate in (("training", False), ("waiting-for-batch", True), ("checkpointing", True)):
        phase(model, "trainer-0", name)
        assert engine_may_generate(model, scheduler, engine) is may_generate, name
    scheduler.batches[0] = object()  # type: ignore[assignment]  # the batch of step 0 is formed
    phase(model, "trainer-0", "waiting-for-batch")
    assert not engine_may_generate(model, scheduler, engine), "the trainer is about to step"
    model.apply(event("WorkerExited", 3.0, slot="rollout-0", wid=engine.wid, exit_code=1, signal=None))
    assert trainer_may_step(model, scheduler, trainer), "an engine that is gone holds no memory"


def test_an_engine_takes_the_weights_from_the_trainer_on_its_node_only() -> None:
    model = colocated_job()
    model.apply(event("WeightsHeld", 2.0, slot="rollout-0", version=3, source={"holder": "rollout-0"}))
    model.apply(event("WeightsPublished", 2.0, version=3, slot="trainer-0", source={"holder": "trainer-0"}))
    model.apply(event("NodeAllocated", 2.0, node="node07", host="h", role="rollout", slot="rollout-9",
                      slots={"rollout-9": [0]}))
    model.apply(event("WorkerStarting", 2.0, slot="rollout-9", wid=model.next_wid("rollout-9"), node="node07", role="rollout"))
    model.apply(event("WorkerStarted", 2.0, slot="rollout-9", wid=model.slots["rollout-9"].wid, pid=1))
    model.apply(event("WeightsHeld", 2.0, slot="rollout-9", version=3, source={"holder": "rollout-9"}))
    model.apply(event("WorkerExited", 2.5, slot="rollout-0", wid=model.slots["rollout-0"].wid, exit_code=1, signal=None))
    model.apply(event("WorkerStarting", 3.0, slot="rollout-0", wid=model.next_wid("rollout-0"), node="node01", role="rollout"))
    model.apply(event("WorkerStarted", 3.0, slot="rollout-0", wid=model.slots["rollout-0"].wid, pid=2))
    assert model.weights_sources(3, exclude_slot="rollout-0") == [{"holder": "trainer-0"}]
    assert {s["holder"] for s in model.weights_sources(3, exclude_slot="rollout-9")} == {"trainer-0"}


def test_a_lost_colocated_node_hands_the_trainer_to_the_standby_and_restarts_the_engine_beside_it() -> None:
    model = colocated_job()
    for slot in ("rollout-0", "trainer-0", None):
        steps = plan(model, verdict("node01", slot, "node-loss", "replace-node"), 2)
        assert kinds(steps) == ["fail-node", "stop-worker", "activate-standby", "move-slot", "restart-worker",
                                "request-spare"], slot
        assert steps[2].journal_fields() == {"slot": "trainer-0", "standby_slot": "standby-0"}
        assert steps[3].journal_fields() == {"slot": "rollout-0", "node": "node05"}
        assert steps[4].journal_fields() == {"slot": "rollout-0"}


def test_without_a_ready_standby_the_whole_colocated_node_moves_together() -> None:
    steps = plan(colocated_job(standby_phase="loading"), verdict("node01", "rollout-0", "node-loss", "replace-node"), 2)
    assert kinds(steps) == ["fail-node", "retire-standby", "move-slot", "move-slot", "restart-worker", "restart-worker"]
    assert {s.journal_fields()["slot"] for s in steps if s.kind == "move-slot"} == {"trainer-0", "rollout-0"}


def test_an_engine_crash_on_a_colocated_node_restarts_the_engine_alone() -> None:
    steps = plan(colocated_job(), verdict("node01", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["restart-worker"] and steps[0].journal_fields() == {"slot": "rollout-0"}
