"""The job model: ETTR weighting by fault impact, recovery bookkeeping, idle phases never judged."""

from __future__ import annotations

import pytest

from rlctl.core.detector import Detector, DetectorConfig, WorkerObs
from rlctl.core.events import event
from rlctl.core.model import JobModel
from tests.core.test_policy import running_job


def test_rollout_fault_impairs_half_the_job_and_recovery_closes_it() -> None:
    model = running_job()
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={"port": 1}))
    model.apply(event("FaultInjected", 20.0, fault_id="f1", node="node02", kind="crash", params={}))
    model.apply(event("Verdict", 21.0, node="node02", slot="rollout-0", verdict="failed", fault="f1",
                      fault_kind="worker-crash", action="restart-worker", reason="died", evidence_since=20.0))
    model.apply(event("WorkerStarting", 21.0, slot="rollout-0", wid=model.next_wid("rollout-0"), node="node02", role="rollout"))
    model.apply(event("WeightsHeld", 25.0, version=0, slot="rollout-0", source={"port": 2}))
    fault = model.faults["f1"]
    assert (fault.detected_at, fault.recovered_at) == (21.0, 25.0)
    model.apply(event("JobStateChanged", 30.0, state="starting", reason="x"))
    seconds = model.ledger.seconds
    assert seconds["detection"] == pytest.approx(0.5)   # 1 s at half impact (one of two rollouts)
    assert seconds["recovery"] == pytest.approx(2.0)    # 4 s at half impact
    assert sum(seconds.values()) == pytest.approx(29.0)


def test_the_same_fault_injected_twice_is_seen_and_recovered_once() -> None:
    """Two hangs of one rollout in the same second (an operator's second `inject-fault`, or a chaos
    soak): one verdict sees them, one restart ends both. Before, the second stayed open and undetected,
    and from then on the ledger counted half the job's time as detection."""
    model = running_job()
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={"port": 1}))
    for fault_id in ("f1", "f2"):
        model.apply(event("FaultInjected", 20.0, fault_id=fault_id, node="node02", kind="hang", params={}))
    model.apply(event("Verdict", 28.0, node="node02", slot="rollout-0", verdict="failed", fault="f1",
                      fault_kind="worker-hang", action="restart-worker", reason="frozen", evidence_since=20.0))
    model.apply(event("WorkerStarting", 28.0, slot="rollout-0", wid=model.next_wid("rollout-0"), node="node02", role="rollout"))
    model.apply(event("WeightsHeld", 31.0, version=0, slot="rollout-0", source={"port": 2}))
    assert [(f.detected_at, f.recovered_at) for f in model.faults.values()] == [(28.0, 31.0), (28.0, 31.0)]
    model.apply(event("JobStateChanged", 100.0, state="starting", reason="x"))
    assert model.ledger.seconds["detection"] == pytest.approx(4.0)  # 8 s at half impact, not 84 s
    # A transient fault that heals ends only itself; a fault of another worker is a fault of its own.
    model.apply(event("FaultInjected", 110.0, fault_id="f3", node="node02", kind="slow", params={}))
    model.apply(event("FaultInjected", 110.0, fault_id="f4", node="node02", kind="crash", params={}))
    model.apply(event("FaultInjected", 110.0, fault_id="f5", node="node03", kind="crash", params={}))
    model.apply(event("FaultRecovered", 112.0, fault_ids=["f3"], slot="rollout-0", node="node02"))
    assert [f.fault_id for f in model.open_faults()] == ["f4", "f5"]
    # A verdict whose plan replaces the worker sees every fault of that process: a hang and a crash
    # of one rollout in the same instant are one failure.
    model.apply(event("FaultInjected", 120.0, fault_id="f6", node="node02", kind="hang", params={}))
    model.apply(event("Verdict", 121.0, node="node02", slot="rollout-0", verdict="failed", fault="f4",
                      fault_kind="worker-crash", action="restart-worker", reason="died", evidence_since=120.0))
    assert {f.fault_id: f.detected_at for f in model.faults.values() if f.open} == {"f4": 121.0, "f5": None, "f6": 121.0}


def test_trainer_fault_impairs_the_whole_job() -> None:
    model = running_job()
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={"port": 1}))
    model.apply(event("FaultInjected", 20.0, fault_id="f1", node="node01", kind="crash", params={}))
    model.apply(event("JobStateChanged", 22.0, state="starting", reason="x"))
    assert model.ledger.seconds["detection"] == pytest.approx(2.0)


def test_retrained_steps_count_as_lost_after_a_trainer_restore() -> None:
    model = running_job()
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={}))
    for step in range(3):
        model.apply(event("WorkerPhase", 11.0 + step, slot="trainer-0", wid=model.slots["trainer-0"].wid,
                          phase="training", step=step))
        model.apply(event("StepTrained", 11.5 + step, step=step, metrics={}))
    model.apply(event("TrainerRestored", 20.0, slot="trainer-0", checkpoint_step=1, replayed_steps=[1, 2]))
    assert model.ledger.seconds["lost"] == pytest.approx(1.0)


def test_the_trainer_state_is_offered_only_while_its_publisher_runs() -> None:
    model = running_job()
    trainer = model.slots["trainer-0"]
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={"port": 1}))
    assert model.live_trainer_state() is None  # no state_source: nothing to offer
    model.apply(event("WeightsPublished", 11.0, version=1, slot="trainer-0", source={"port": 1},
                      state_source={"port": 2, "version": 1}))
    offer = model.live_trainer_state()
    assert offer is not None and (offer.version, offer.wid, offer.source["port"]) == (1, trainer.wid, 2)
    model.apply(event("WorkerExited", 12.0, slot="trainer-0", wid=trainer.wid, exit_code=None, signal="SIGKILL"))
    assert model.live_trainer_state() is None  # its server died with it: a standby must not wait on it


def standby_crashed_and_reloading(model: JobModel) -> str:
    """The warm standby ``standby-0`` crashed (fault ``f1``, seen) and its restart is loading; its new wid."""
    standby = model.slots["standby-0"]
    model.apply(event("FaultInjected", 20.0, fault_id="f1", node="node05", kind="crash", params={}))
    assert model.faults["f1"].slot == "standby-0" and model.faults["f1"].impact == 0.0
    model.apply(event("WorkerExited", 20.1, slot="standby-0", wid=standby.wid, exit_code=None, signal="SIGKILL"))
    model.apply(event("Verdict", 20.2, node="node05", slot="standby-0", verdict="failed", fault="f1",
                      fault_kind="worker-crash", action="restart-worker", reason="died", evidence_since=20.0))
    wid = model.next_wid("standby-0")
    model.apply(event("WorkerStarting", 20.3, slot="standby-0", wid=wid, node="node05", role="trainer", standby=True))
    model.apply(event("WorkerPhase", 21.0, slot="standby-0", wid=wid, phase="loading", step=0))
    assert model.faults["f1"].recovered_at is None
    return wid


def test_a_crashed_warm_standby_is_recovered_once_its_restart_is_standing_by_again() -> None:
    model = running_job()
    wid = standby_crashed_and_reloading(model)
    model.apply(event("WorkerPhase", 25.0, slot="standby-0", wid=wid, phase="standby", step=0))
    assert model.faults["f1"].recovered_at == 25.0


def test_a_crashed_standby_whose_node_is_taken_for_a_role_while_it_reloads_has_nothing_left_to_recover() -> None:
    """The standby crashed and is reloading when the trainer's node dies: its spare node is re-used
    for the trainer (vacate-slot). Its fault ends there; it stayed open to the end of the run before."""
    model = running_job()
    standby_crashed_and_reloading(model)
    model.apply(event("ActionTaken", 24.0, action="vacate-slot", node="node05", slot="standby-0",
                      reason="spare node re-used"))
    assert model.faults["f1"].recovered_at == 24.0 and not model.open_faults()


def test_a_fault_free_run_through_every_idle_phase_raises_no_verdict() -> None:
    bounds = {"generating": 2.0, "training": 2.0, "weight-sync": 120.0, "checkpointing": 300.0, "compiling": 900.0,
              "loading": 600.0, "waiting-for-work": 5.0, "waiting-for-batch": 5.0, "scoring": 2.0}
    d = Detector(DetectorConfig(1.0, 8.0, 2.0, True, bounds, 0.35, 10.0))
    now = 0.0
    verdicts = []
    # Long idle stretches (a trainer waiting for a slow rollout phase, a long first compile) keep
    # polling, or stay within their phase's generous bound (progress is counted from the phase's
    # start); busy phases make progress.
    for phase, seconds, progressing, polling in [
        ("compiling", 60.0, False, False), ("loading", 30.0, False, False), ("waiting-for-batch", 120.0, False, True),
        ("training", 10.0, True, False), ("checkpointing", 40.0, False, False), ("weight-sync", 40.0, False, False),
        ("waiting-for-work", 300.0, False, True), ("generating", 20.0, True, False), ("standby", 600.0, False, True),
    ]:
        began, end = now, now + seconds
        while now < end:
            now += 0.5
            worker = WorkerObs("trainer-0", "t.1", "trainer", "n1", phase, now if progressing else 0.0,
                               progress_age_s=0.2 if progressing else now - began,
                               request_age_s=0.2 if polling else None)
            verdict = d.worker_verdict(worker, now)
            if verdict is not None:
                verdicts.append(verdict)
    assert verdicts == []


def test_a_joiner_is_offered_every_live_holder_rollouts_first_for_a_striped_pull() -> None:
    model = running_job()
    model.apply(event("WeightsPublished", 10.0, version=0, slot="trainer-0", source={"port": 1}))
    model.apply(event("WeightsHeld", 11.0, version=0, slot="rollout-0", source={"port": 2}))
    model.apply(event("WeightsHeld", 11.0, version=0, slot="rollout-1", source={"port": 3}))
    ports = [s["port"] for s in model.weights_sources(0)]
    assert sorted(ports[:2]) == [2, 3] and ports[2] == 1
    assert [s["port"] for s in model.weights_sources(0, exclude_slot="rollout-0")][-1] == 1
    assert 2 not in [s["port"] for s in model.weights_sources(0, exclude_slot="rollout-0")]
    assert len(model.weights_sources(0, limit=2)) == 2 and model.weights_source(0) == model.weights_sources(0)[0]
    rollout = model.slots["rollout-1"]
    model.apply(event("WorkerExited", 12.0, slot="rollout-1", wid=rollout.wid, exit_code=1, signal=None))
    assert 3 not in [s["port"] for s in model.weights_sources(0)]
