"""Recovery plans: role policy recovers only what failed; full-restart stops everything."""

from __future__ import annotations

from rlctl.core.detector import Verdict
from rlctl.core.events import event
from rlctl.core.model import JobModel
from rlctl.core.policy import Claims, plan


def running_job(policy: str = "role", spares: int = 1, trainers: int = 1) -> JobModel:
    model = JobModel(job_id="j")
    t = 1.0
    model.apply(event("JobSubmitted", t, job_id="j", spec_file="x", backend="local", policy=policy, steps=10))
    layout = [("node01", "trainer", "trainer-0", False), ("node02", "rollout", "rollout-0", False),
              ("node03", "rollout", "rollout-1", False), ("node04", "reward", "reward-0", False)]
    layout += [(f"node{20 + i:02d}", "trainer", f"trainer-{i}", False) for i in range(1, trainers)]
    layout += [(f"node{5 + i:02d}", "spare", f"standby-{i}", True) for i in range(spares)]
    for node, role, slot, standby in layout:
        model.apply(event("NodeAllocated", t, node=node, host="h", role=role, slot=slot, standby=standby,
                          role_of_slot="trainer" if standby else role))
        model.apply(event("AgentRegistered", t, node=node, incarnation=1, facts={}))
        model.apply(event("NodeStateChanged", t, node=node, state="ready", reason="up"))
        model.apply(event("NodeStateChanged", t, node=node, state="standby" if standby else "active", reason="placed"))
        model.apply(event("WorkerStarting", t, slot=slot, wid=model.next_wid(slot), node=node,
                          role="trainer" if standby else role, standby=standby))
        model.apply(event("WorkerStarted", t, slot=slot, wid=model.slots[slot].wid, pid=1))
        if standby:
            model.apply(event("WorkerPhase", t, slot=slot, wid=model.slots[slot].wid, phase="standby", step=0))
    return model


def verdict(node: str, slot: str | None, fault: str, action: str) -> Verdict:
    return Verdict(node, slot, "failed", fault, action, "test", 1.0)


def kinds(steps: list) -> list[str]:
    return [s.kind for s in steps]


def test_rollout_crash_without_a_ready_standby_restarts_only_that_worker() -> None:
    steps = plan(running_job(spares=0), verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["restart-worker"] and steps[0].journal_fields() == {"slot": "rollout-0"}


def test_rollout_crash_with_a_ready_standby_hands_over_and_refills_the_spare() -> None:
    steps = plan(running_job(), verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["stop-worker", "activate-standby", "make-standby"]
    assert steps[1].journal_fields() == {"slot": "rollout-0", "standby_slot": "standby-0"}
    assert steps[2].journal_fields() == {"node": "node02"}


def test_a_loading_standby_is_not_used() -> None:
    model = running_job()
    model.slots["standby-0"].phase = "loading"
    assert kinds(plan(model, verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)) == ["restart-worker"]


def test_repeated_restarts_on_one_node_retire_it() -> None:
    model = running_job(spares=0)
    model.slots["rollout-0"].restarts_on_node = 2
    steps = plan(model, verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["fail-node", "request-node"]


def test_node_loss_of_a_rollout_uses_the_standby_and_refills_the_spare_pool() -> None:
    steps = plan(running_job(), verdict("node03", None, "node-loss", "replace-node"), 2)
    assert kinds(steps) == ["fail-node", "stop-worker", "activate-standby", "request-spare"]
    assert steps[2].journal_fields() == {"slot": "rollout-1", "standby_slot": "standby-0"}
    assert steps[3].journal_fields() == {"exclude_node": "node03"}


def test_without_spares_a_new_node_is_requested_for_a_lost_node() -> None:
    steps = plan(running_job(spares=0), verdict("node03", None, "node-loss", "replace-node"), 2)
    assert kinds(steps) == ["fail-node", "request-node"]


def test_trainer_failure_activates_the_warm_standby_and_keeps_the_healthy_node() -> None:
    steps = plan(running_job(), verdict("node01", "trainer-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["stop-worker", "activate-standby", "make-standby"]
    assert steps[1].journal_fields() == {"slot": "trainer-0", "standby_slot": "standby-0"}


def test_trainer_node_loss_activates_the_standby_and_retires_the_node() -> None:
    steps = plan(running_job(), verdict("node01", None, "gpu-lost", "replace-node"), 2)
    assert kinds(steps) == ["fail-node", "stop-worker", "activate-standby", "request-spare"]


def test_nccl_timeout_restarts_only_the_trainer_group() -> None:
    steps = plan(running_job(), verdict("node02", "rollout-0", "nccl-timeout", "restart-role"), 2)
    assert kinds(steps) == ["restart-worker"] and steps[0].journal_fields() == {"slot": "rollout-0"}
    steps = plan(running_job(spares=0), verdict("node01", "trainer-0", "nccl-timeout", "restart-role"), 2)
    assert [(s.kind, s.journal_fields()["slot"]) for s in steps] == [("restart-worker", "trainer-0")]


def test_agent_loss_restarts_the_agent_only() -> None:
    assert kinds(plan(running_job(), verdict("node02", None, "agent-lost", "restart-agent"), 2)) == ["restart-agent"]


def test_observations_need_no_action() -> None:
    assert plan(running_job(), verdict("node02", None, "gpu-remap-pending", "observe"), 2) == []


def test_full_restart_stops_everything_and_rolls_back() -> None:
    model = running_job(policy="full-restart")
    model.apply(event("Checkpointed", 2.0, step=5, path="/c"))
    steps = plan(model, verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["stop-all", "rollback", "start-all"]
    assert steps[1].journal_fields() == {"to_step": 5}
    lost = plan(model, verdict("node03", None, "node-loss", "replace-node"), 2)
    assert kinds(lost)[:2] == ["stop-all", "fail-node"] and kinds(lost)[-2:] == ["rollback", "start-all"]


def test_full_restart_brings_a_lost_agent_back() -> None:
    steps = plan(running_job(policy="full-restart"), verdict("node01", None, "agent-lost", "restart-agent"), 2)
    assert kinds(steps) == ["stop-all", "restart-agent", "rollback", "start-all"]


def test_a_failed_data_parallel_rank_restarts_the_whole_trainer_group() -> None:
    model = running_job(trainers=2)
    steps = plan(model, verdict("node20", "trainer-1", "worker-crash", "restart-worker"), 2)
    assert [(s.kind, s.journal_fields().get("slot")) for s in steps] == [("restart-worker", "trainer-1"),
                                                             ("restart-worker", "trainer-0")]
    lost = plan(model, verdict("node01", "trainer-0", "node-loss", "replace-node"), 2)
    assert kinds(lost)[0] == "fail-node" and "activate-standby" not in kinds(lost), "a standby holds no rank"
    assert lost[-1].kind == "restart-worker" and lost[-1].journal_fields() == {"slot": "trainer-1"}


def test_a_single_trainer_still_hands_over_to_its_warm_standby() -> None:
    steps = plan(running_job(), verdict("node01", "trainer-0", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["stop-worker", "activate-standby", "make-standby"]


def test_a_lone_trainer_collective_timeout_is_handed_to_the_warm_standby() -> None:
    steps = plan(running_job(), verdict("node01", "trainer-0", "nccl-timeout", "restart-role"), 2)
    assert kinds(steps) == ["stop-worker", "activate-standby", "make-standby"]
    group = plan(running_job(trainers=2), verdict("node01", "trainer-0", "nccl-timeout", "restart-role"), 2)
    assert [(s.kind, s.journal_fields()["slot"]) for s in group] == [("restart-worker", "trainer-0"), ("restart-worker", "trainer-1")]


def test_a_spare_whose_standby_is_not_ready_is_cleared_before_a_slot_moves_onto_it() -> None:
    """A node never runs two workers: the standby still loading on the spare is retired first."""
    model = running_job()
    model.apply(event("WorkerPhase", 2.0, slot="standby-0", wid=model.slots["standby-0"].wid, phase="loading", step=0))
    steps = plan(model, verdict("node02", None, "node-loss", "replace-node"), 2)
    assert [(s.kind, s.journal_fields().get("slot") or s.journal_fields().get("standby_slot") or s.journal_fields().get("node")) for s in steps] == [
        ("fail-node", "node02"), ("retire-standby", "standby-0"), ("move-slot", "rollout-0"), ("restart-worker", "rollout-0")]
    assert steps[2].journal_fields()["node"] == "node05"


def test_a_standby_that_fails_is_started_again_and_no_role_moves() -> None:
    # A hung or crashed standby is not a role's fault: nothing is handed over (to another standby, or to itself).
    steps = plan(running_job(spares=2), verdict("node06", "standby-1", "worker-hang", "restart-worker"), 2)
    assert [(s.kind, s.journal_fields()) for s in steps] == [("restart-worker", {"slot": "standby-1"})]


def test_a_standby_that_keeps_failing_or_whose_node_is_bad_retires_its_node() -> None:
    model = running_job(spares=2)
    model.slots["standby-1"].restarts_on_node = 2
    steps = plan(model, verdict("node06", "standby-1", "worker-crash", "restart-worker"), 2)
    assert kinds(steps) == ["stop-worker", "fail-node", "request-spare"]
    steps = plan(running_job(spares=2), verdict("node06", "standby-1", "gpu-lost", "replace-node"), 2)
    assert kinds(steps) == ["stop-worker", "fail-node", "request-spare"] and steps[2].journal_fields() == {"exclude_node": "node06"}


def test_a_standby_another_plan_activates_is_not_offered_to_the_next_plan() -> None:
    """A rollout and the lone trainer crash in the same instant with one warm standby. The rollout's
    plan claims the standby; the trainer's plan, made before the standby took the rollout's role,
    used to claim it too, and the trainer was never started again (found by hypothesis)."""
    model = running_job()
    first = plan(model, verdict("node02", "rollout-0", "worker-crash", "restart-worker"), 2)
    assert first[1].journal_fields()["standby_slot"] == "standby-0"
    second = plan(model, verdict("node01", "trainer-0", "worker-crash", "restart-worker"), 2, Claims.of(first))
    assert [(s.kind, s.journal_fields()) for s in second] == [("restart-worker", {"slot": "trainer-0"})]


def test_a_spare_node_another_plan_moves_slots_onto_is_not_offered_to_the_next_plan() -> None:
    model = running_job(spares=0)
    model.apply(event("NodeAllocated", 2.0, node="node09", host="h", role="spare", slot="", standby=True))
    model.apply(event("AgentRegistered", 2.0, node="node09", incarnation=1, facts={}))
    model.apply(event("NodeStateChanged", 2.0, node="node09", state="ready", reason="up"))
    first = plan(model, verdict("node02", None, "node-loss", "replace-node"), 2)
    assert ("move-slot", "node09") in [(s.kind, s.journal_fields().get("node")) for s in first]
    second = plan(model, verdict("node03", None, "node-loss", "replace-node"), 2, Claims.of(first))
    assert kinds(second) == ["fail-node", "request-node"]
    assert Claims.of(first) == Claims(frozenset({"rollout-0"}), frozenset({"node09"}))


def test_the_standby_holding_the_trainer_replica_is_kept_for_a_restarting_trainer_group() -> None:
    """A rollout that fails while the trainer group restarts does not take the standby whose
    in-memory copy of the trainer state the group is about to restore from."""
    model = running_job(trainers=2)
    for rank in ("trainer-0", "trainer-1"):
        model.slots[rank].serving = True
    standby = model.slots["standby-0"]
    model.apply(event("TrainerStateHeld", 2.0, slot="standby-0", wid=standby.wid, step=4,
                      source={"sharded": True, "shards": [{}, {}]}))
    rollout_fails = verdict("node02", "rollout-0", "worker-crash", "restart-worker")
    assert kinds(plan(model, rollout_fails, 2)) == ["stop-worker", "activate-standby", "make-standby"], \
        "the trainers serve: the standby may take the rollout"
    for step in plan(model, verdict("node20", "trainer-1", "worker-crash", "restart-worker"), 2):
        model.apply(event("WorkerStarting", 3.0, slot=step.journal_fields()["slot"], wid=model.next_wid(
            step.journal_fields()["slot"]), node=model.slots[step.journal_fields()["slot"]].node, role="trainer"))
    assert kinds(plan(model, rollout_fails, 2)) == ["restart-worker"], "the group restores from the standby's copy"
