"""The orchestration core on its own: observations in, events and effects out, with a shell that
keeps what it is given (a journal in a list, plans stepped by hand)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rlctl.core import detector as det
from rlctl.core import effects as fx
from rlctl.core import orchestrate as orc
from rlctl.core.event_payloads import FaultInjectedData
from rlctl.core.events import EventKind, event
from rlctl.core.states import WorkerState
from rlctl.core.tick import Observations
from tests.core.shells import RecordingShell
from tests.core.test_policy import running_job, verdict
from tests.core.test_rounds import make_scheduler


def orchestrator(policy: str = "role", spares: int = 0) -> tuple[orc.Orchestrator, RecordingShell]:
    model = running_job(policy=policy, spares=spares)
    for state in ("starting", "running"):
        model.apply(event(EventKind.JOB_STATE_CHANGED, 2.0, state=state, reason="test"))
    scheduler = make_scheduler(tail=False)
    model.scheduler = scheduler
    shell = RecordingShell(model)
    spec = SimpleNamespace(fault_tolerance=SimpleNamespace(max_restarts_per_slot=3, max_failed_starts=3, min_silence_s=3.0, stall_s=0.0,
                                                                   exclude_failed_nodes=True),
                           warm_spares=False)
    detector = det.Detector(det.DetectorConfig(heartbeat_interval_s=1.0, phi_threshold=8.0, min_silence_s=3.0,
                                               confirm_with_probe=True, phase_timeout_s={}, slow_ratio=0.5,
                                               slow_window_s=10.0))
    return orc.Orchestrator(spec, model, scheduler, detector, shell), shell  # type: ignore[arg-type]


def step_through(shell: RecordingShell, plan: fx.Plan, answers: dict[type, Any] | None = None) -> list[fx.Effect]:
    """Every effect of ``plan``, answering each with ``answers[type]`` (None by default); a Sleep
    moves the shell's clock on."""
    effects: list[fx.Effect] = []
    result: Any = None
    while True:
        try:
            effect = plan.send(result)
        except StopIteration:
            return effects
        effects.append(effect)
        if isinstance(effect, fx.Sleep):
            shell.now += effect.seconds
        result = (answers or {}).get(type(effect))


def kinds(shell: RecordingShell) -> list[str]:
    return [f"{e.type}:{e.data.get('action', e.data.get('state', ''))}" for e in shell.journal]


def test_a_crash_becomes_a_verdict_and_a_restart_plan_of_effects() -> None:
    core, shell = orchestrator()
    wid = core.model.slots["rollout-0"].wid
    core.worker_exited(wid, 1, None)
    assert kinds(shell)[:3] == ["WorkerExited:", "Verdict:restart-worker", "JobStateChanged:recovering"]
    effects = step_through(shell, shell.pending.pop())
    stop, start = effects[0], effects[1]
    assert isinstance(stop, fx.StopWorker) and stop.wid == wid and stop.wait
    assert isinstance(start, fx.StartWorker) and start.slot == "rollout-0" and start.wid != wid
    assert all(isinstance(e, fx.Sleep) for e in effects[2:])  # the cool-down polls, nothing more
    assert "ActionTaken:restart-worker" in kinds(shell)


def test_a_second_verdict_for_a_slot_under_recovery_is_journaled_but_not_acted_on() -> None:
    core, shell = orchestrator()
    slot = core.model.slots["rollout-0"]
    core.handle(verdict("node02", "rollout-0", "worker-hang", "restart-worker"))
    assert len(shell.pending) == 1 and "rollout-0" in core.recovery.busy_slots
    shell.commit([event(EventKind.FAULT_INJECTED, 11.0, fault_id="inj-1", node="node02", kind="crash", params={})])
    core.worker_exited(slot.wid or "", 1, None)  # the worker the plan restarts crashed meanwhile
    assert len(shell.pending) == 1  # no second plan
    assert core.model.faults["inj-1"].detected_at is not None  # but the fault is seen, not left open


def test_a_node_failure_asks_the_backend_for_a_node_and_starts_its_agent() -> None:
    core, shell = orchestrator()
    core.handle(verdict("node02", None, "node-loss", "replace-node"))
    effects = step_through(shell, shell.pending.pop(), {fx.ReplaceNode: fx.NodeGrant("node09", "h9", "ref9")})
    replace = next(e for e in effects if isinstance(e, fx.ReplaceNode))
    assert replace.bad_node == "node02" and "node02" in replace.exclude
    assert fx.ReleaseNode("node02") in effects and fx.StartAgent("node09") in effects
    assert core.model.slots["rollout-0"].node == "node09" and core.model.nodes["node02"].excluded


def test_no_replacement_node_leaves_the_role_degraded_and_a_lost_trainer_stops_the_job() -> None:
    core, shell = orchestrator()
    core.handle(verdict("node01", None, "node-loss", "replace-node"))
    step_through(shell, shell.pending.pop())  # the backend answers None: no node
    assert core.stop is not None and core.final_state().value == "failed"


def test_during_a_full_restart_no_worker_is_started_until_start_all() -> None:
    core, shell = orchestrator(policy="full-restart")
    core.handle(verdict("node02", "rollout-0", "worker-crash", "restart-worker"))
    plan = shell.pending.pop()
    effects = []
    result: Any = None
    while not any(isinstance(e, fx.StopEverything) for e in effects):
        effects.append(plan.send(result))
    assert core.recovery.restarting_everything
    stopped = next(e for e in effects if isinstance(e, fx.StopEverything)).stops
    core.worker_exited(stopped[0].wid, 0, None)  # its exit does not restart it: start-all will
    assert not shell.pending
    rest = step_through(shell, plan)
    assert not core.recovery.restarting_everything
    assert {e.slot for e in rest if isinstance(e, fx.StartWorker)} == set(core.model.slots)
    assert any(isinstance(e, fx.Requeue) for e in rest)


def test_a_worker_on_a_retired_node_is_not_marked_stopping_so_a_move_can_start_it_again() -> None:
    orc, shell = orchestrator()
    slot = orc.model.slots["rollout-0"]
    orc.model.apply(event(EventKind.NODE_STATE_CHANGED, 3.0, node=slot.node, state="failed", reason="retired"))
    assert orc.stop_worker(slot) is None
    assert slot.phase != "stopping" and not [e for e in shell.journal if e.type == EventKind.WORKER_PHASE]
    orc.model.apply(event(EventKind.ACTION_TAKEN, 4.0, action="move-slot", node="node04", slot="rollout-0", reason="replacement node", fault_ids=[]))
    slot.life.move(WorkerState.EXITED, 4.0, "node failed")  # what fail-node journaled for it
    assert orc.wants_worker(slot)


def test_two_full_restarts_that_overlap_leave_each_slot_one_worker() -> None:
    """A full restart's start-all can run late (its requeue waits), after a second full restart has
    stopped everything. The second one's start-all then finds every slot already started and starts
    none again: a second worker in a slot would strand the prompts dispatched to the first (the
    simulator found this as a job that never trained again)."""
    core, shell = orchestrator(policy="full-restart")
    core.handle(verdict("node02", "rollout-0", "worker-crash", "restart-worker"))
    first = shell.pending.pop()
    result: Any = None
    effects: list[fx.Effect] = []
    while not isinstance(effect := first.send(result), fx.Requeue):
        effects.append(effect)
        result = None
    for stop in next(e for e in effects if isinstance(e, fx.StopEverything)).stops:
        core.worker_exited(stop.wid, 0, None)
    core.handle(verdict("node01", "trainer-0", "worker-crash", "restart-worker"))
    second = shell.pending.pop()
    while not isinstance(effect := second.send(None), fx.StopEverything):
        pass
    assert effect.stops == ()  # the first restart stopped them all already
    started_first = [e for e in step_through(shell, first) if isinstance(e, fx.StartWorker)]
    assert {e.slot for e in started_first} == set(core.model.slots)
    started_second = [e for e in step_through(shell, second) if isinstance(e, fx.StartWorker)]
    assert started_second == []
    assert {s.slot: s.wid for s in core.model.slots.values()} == {e.slot: e.wid for e in started_first}
    assert all(s.life is not None and s.life.state == WorkerState.STARTING for s in core.model.slots.values())


def test_a_worker_that_fails_after_its_plan_restored_the_slot_is_restarted_when_the_plan_ends() -> None:
    """A plan restores a slot (the warm standby takes the lost node's role) and then waits for a
    spare node. The standby's worker crashes meanwhile: the verdict is journaled, and when the plan
    ends the slot, still without a live worker, is restarted. Before, the crash was never acted on
    and the job waited forever (the simulator found it). A crash of the worker that restart started
    is a new fault too, not the old one seen again."""
    core, shell = orchestrator(spares=1)
    core.handle(verdict("node02", "rollout-0", "gpu-ecc-dbe", "drain-replace"))
    plan = shell.pending.pop()
    while not isinstance(plan.send(None), fx.ReplaceNode):
        pass
    slot = core.model.slots["rollout-0"]
    assert slot.node == "node05" and slot.wid == "standby-0.5"
    shell.commit([event(EventKind.FAULT_INJECTED, 11.0, fault_id="inj-1", node="node05", kind="crash", params={})])
    core.worker_exited("standby-0.5", 1, None)
    assert not shell.pending and kinds(shell)[-1] == "Verdict:restart-worker"
    step_through(shell, plan)  # no spare node: the plan ends
    restart = step_through(shell, shell.pending.pop())
    started = [e for e in restart if isinstance(e, fx.StartWorker)]
    assert [(e.slot, e.node) for e in started] == [("rollout-0", "node05")]
    assert "ActionTaken:restart-worker" in kinds(shell) and core.model.faults["inj-1"].detected_at is not None
    core.worker_exited(started[0].wid, 1, None)
    assert shell.pending, "the restarted worker's crash was taken for the old fault"


def test_a_restart_on_a_node_without_its_agent_is_left_to_the_agents_registration() -> None:
    """A plan that restarts a slot whose worker is gone, on a node whose agent is not up (a node
    another plan brought in, still registering), sends nothing there: the start would be lost and the
    slot left 'starting' forever (the simulator found a trainer group that never stepped again). The
    agent's registration starts it."""
    core, shell = orchestrator()
    slot = core.model.slots["rollout-0"]
    core.worker_exited(slot.wid or "", 1, None)
    shell.agents_connected = False
    effects = step_through(shell, shell.pending.pop())
    assert not [e for e in effects if isinstance(e, (fx.StartWorker, fx.StopWorker))]
    assert "ActionTaken:restart-worker" in kinds(shell) and slot.life is not None
    assert slot.life.state == WorkerState.FAILED
    shell.agents_connected = True
    core.agent_registered("node02", 2, {}, set())
    started = [e for e in step_through(shell, shell.pending.pop()) if isinstance(e, fx.StartWorker)]
    assert [(e.slot, e.node) for e in started] == [("rollout-0", "node02")]


def restart_until_started(shell: RecordingShell) -> str:
    """Step the pending restart plan until it started the slot's new worker and waits in its cool-down
    (its verdict still handled); the new worker's id."""
    plan = shell.pending.pop()
    wid = ""
    while not (isinstance(effect := plan.send(None), fx.Sleep) and wid):
        if isinstance(effect, fx.StartWorker):
            wid = effect.wid
    shell.pending.append(plan)
    return wid


def test_a_restarted_worker_that_crashes_while_it_loads_is_restarted_again() -> None:
    """The live repro of issue 30: a crash, and a second crash of the new worker while its restart
    plan cools down. The second exit was taken for the first fault seen again and dropped: the slot
    stayed failed, the job 'recovering' to its end."""
    core, shell = orchestrator()
    slot = core.model.slots["rollout-0"]
    slot.serving = True
    core.worker_exited(slot.wid or "", None, "SIGKILL")
    new_wid = restart_until_started(shell)
    shell.commit([event(EventKind.WORKER_STARTED, shell.now, slot="rollout-0", wid=new_wid, pid=4242)])
    core.worker_exited(new_wid, None, "SIGKILL")
    verdicts = [e for e in shell.journal if e.type == EventKind.VERDICT]
    assert [v.data.get("wid") for v in verdicts][-1] == new_wid
    assert len(shell.pending) == 2, "the new worker's crash got no plan of its own"
    started = [e for e in step_through(shell, shell.pending.pop()) if isinstance(e, fx.StartWorker)]
    assert [e.slot for e in started] == ["rollout-0"] and started[0].wid != new_wid


def test_a_slot_whose_workers_never_start_gives_the_job_up_naming_the_worker_and_its_error() -> None:
    core, shell = orchestrator()
    slot = core.model.slots["rollout-0"]
    slot.serving = True
    core.worker_exited(slot.wid or "", 1, None, error="RuntimeError: CUDA out of memory")  # a serving worker: no count
    for attempt in range(1, 4):
        new_wid = step_and_start(shell)
        assert core.stop is None, f"gave up after {attempt - 1} failed starts"
        core.worker_exited(new_wid, 1, None, error="safetensors_rust.SafetensorError: header too large")
        assert slot.failed_starts == attempt
    effects = step_through(shell, shell.pending.pop())
    assert not [e for e in effects if isinstance(e, fx.StartWorker)]
    assert core.stop is not None and core.stop.reason.startswith("failed: ")
    assert new_wid in core.stop.reason and "3 starts" in core.stop.reason
    assert "SafetensorError: header too large" in core.stop.reason
    assert any(e.type == EventKind.JOB_STATE_CHANGED and e.data["state"] == "stopping" for e in shell.journal)


def step_and_start(shell: RecordingShell) -> str:
    """Run the pending restart plans to their end; the id of the worker the last one started."""
    wid = ""
    while shell.pending:
        for effect in step_through(shell, shell.pending.pop()):
            if isinstance(effect, fx.StartWorker):
                wid = effect.wid
    return wid


def test_an_injected_fault_that_heals_by_itself_unseen_ends_when_its_duration_does() -> None:
    c, shell = orchestrator()
    shell.now = 10.0
    for fault_id, kind, params in (("f-slow", "slow", {"duration": 5.0, "factor": 3.0}), ("f-crash", "crash", {}),
                                   ("f-late", "hang", {"duration": 2.0, "after": 10.0})):
        c.record(FaultInjectedData(fault_id=fault_id, node="node02", kind=kind, params=params))
    assert c.model.faults["f-slow"].heals_at == 15.0 and c.model.faults["f-late"].heals_at == 22.0
    assert c.model.faults["f-crash"].heals_at is None
    c.reconcile(14.9, Observations())
    assert all(f.open for f in c.model.faults.values())
    c.reconcile(15.0, Observations())
    recovered = [e for e in shell.journal if e.type == EventKind.FAULT_RECOVERED]
    assert [e.data["fault_ids"] for e in recovered] == [["f-slow"]] and not c.model.faults["f-slow"].open
    c.model.faults["f-late"].detected_at = 21.0  # a verdict saw it: its recovery ends it, not its duration
    c.reconcile(30.0, Observations())
    assert c.model.faults["f-late"].open and c.model.faults["f-crash"].open
