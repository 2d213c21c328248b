"""The simulator and the live controller reach the same verdicts and plans on the same observations.

Both decide through the one orchestration core (``rlctl.core.orchestrate``). The live side is the
controller's detection (``rlctl.controller.detection``) around a shell that only journals; the sim
side is ``rlctl.sim.observe`` in a paused simulation. Both start from
the same job model: the simulator's own, and one rebuilt by replaying its events (the journal path).
A real local chaos run's journal is also replayed: every plan it journaled is re-derived. And a
whole simulated job's events are fed, moment by moment, to the live tick: at every moment the
simulator opened a round, started a held-out evaluation or finished, the live tick does the same.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from rlctl.controller.detection import WORKER_CHECK_SLICES, Detection, Resumed
from rlctl.core import detector as det
from rlctl.core import policy
from rlctl.core.events import Event, event
from rlctl.core.model import JobModel
from rlctl.core.node_judging import NodeSighting, ProbeAnswer, SightingTable
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.plansteps import Step
from rlctl.core.tick import Observations, TickDecisions, WorkerSightings
from rlctl.sim import observe
from rlctl.sim.calibrate import read_events
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import TraceFailures
from rlctl.spec_loader import load_job_file
from tests.core.shells import RecordingShell
from tests.core.test_rounds import make_scheduler
from tests.sim.conftest import DATA, paused_simulation

PAUSE_S = 1500.0


class StubController(RecordingShell):
    """The live controller's deciding parts (its orchestration core and its detection) around a shell
    that journals into a list and keeps the recovery plans it is asked to run, without running them."""

    def __init__(self, model: JobModel, spec: Any, detector: det.Detector, now: float) -> None:
        super().__init__(model, now)
        self.detector = detector
        self.orc = Orchestrator(spec, model, model.scheduler or make_scheduler(tail=False), detector, self)
        self.last_request_at: dict[str, float] = {}
        self.detection = Detection(self.orc, self.connected, None, {},  # type: ignore[arg-type]
                                   self.last_request_at, Resumed(False, at=0.0), lambda coro: coro.close())

    @property
    def recorded(self) -> list[Event]:
        return self.journal

    @property
    def plans(self) -> list[list[Step]]:
        return [steps for _, steps in self.orc.tally.plans]


def replayed_model(events: list[Event]) -> JobModel:
    model = JobModel(job_id="replayed")
    for ev in events:
        model.apply(ev)
    return model


def all_quiet(stub: StubController) -> None:
    """Every node just beat and every worker just reported progress and polled (the stub has no agents)."""
    for record in stub.model.nodes.values():
        record.last_heartbeat_at = stub.now
    for slot in stub.model.slots.values():
        slot.progress_at = stub.now
        if slot.wid:
            stub.last_request_at[slot.wid] = stub.now


def live_verdicts(stub: StubController) -> list[dict[str, Any]]:
    return [e.data for e in stub.recorded if e.type == "Verdict"]


def sim_side(sim: Any) -> tuple[list[dict[str, Any]], list[list[Step]]]:
    verdicts = [e.data for e in sim.events if e.type == "Verdict"]
    return verdicts, [steps for _, steps in sim.orc.tally.plans]


def comparable(verdict: dict[str, Any]) -> tuple[Any, ...]:
    return (verdict["node"], verdict["slot"], verdict["verdict"], verdict["fault_kind"], verdict["action"], verdict["reason"])


@pytest.fixture(params=["role", "full-restart"])
def paired(request: pytest.FixtureRequest, quickstart: Any) -> tuple[Any, StubController]:
    sim = paused_simulation(quickstart, PAUSE_S, policy=request.param)
    assert sim.model.published_version >= 2, "the job should be training when the observations arrive"
    stub = StubController(replayed_model(sim.events), quickstart, observe.detector_for(quickstart), sim.now)
    return sim, stub


SIGNALS = [("xid", 79), ("xid", 48), ("xid", 13), ("xid", 63), ("ecc-dbe", None), ("nccl-timeout", None), ("throttle", None)]


@pytest.mark.parametrize("kind,code", SIGNALS)
@pytest.mark.parametrize("role_slot", ["trainer-0", "rollout-1", "reward-0"])
def test_fault_signals_give_the_same_verdict_and_plan(paired: tuple[Any, StubController], kind: str, code: int | None,
                                                      role_slot: str) -> None:
    sim, stub = paired
    node = sim.model.slots[role_slot].node
    detail = f"injected {kind}"
    stub.orc.fault_signal(node, kind, code, detail)
    sim.orc.fault_signal(node, kind, code, detail)
    live_v, (sim_v, sim_plans) = live_verdicts(stub), sim_side(sim)
    assert [comparable(v) for v in live_v] == [comparable(v) for v in sim_v]
    assert stub.plans == sim_plans


@pytest.mark.parametrize("role_slot", ["trainer-0", "rollout-0", "reward-0"])
def test_worker_exit_gives_the_same_verdict_and_plan(paired: tuple[Any, StubController], role_slot: str) -> None:
    sim, stub = paired
    live_slot = stub.model.slots[role_slot]
    stub.orc.worker_exited(live_slot.wid, 1, None)
    sim.orc.worker_exited(sim.model.slots[role_slot].wid, 1, None)
    sim_v, sim_plans = sim_side(sim)
    assert [comparable(v)[:5] for v in live_verdicts(stub)] == [comparable(v)[:5] for v in sim_v[-1:]]
    assert stub.plans == sim_plans


def sim_judges(sim: Any, node: str, last: float, probe: ProbeAnswer | None = None) -> TickDecisions:
    """The simulator's tick judging ``node`` silent since ``last`` (every other node beating), as
    ``rlctl.sim.inject`` calls it, carried out."""
    sightings = {name: NodeSighting(name, last if name == node else sim.now, True, probe if name == node else None)
                 for name in sim.model.nodes}
    return sim.orc.reconcile(sim.now, Observations(nodes=SightingTable(sightings), judged_nodes=(node,)))


def live_tick(stub: StubController) -> None:
    """One tick of the live controller: what its detection observes, decided and carried out."""
    decisions = stub.orc.reconcile(stub.now, stub.detection.observe(stub.now, stopping=False))
    stub.detection.carry_out(decisions)


@pytest.mark.parametrize("probe_reaches", [False, True])
def test_heartbeat_silence_gives_the_same_suspicion_verdict_and_plan(paired: tuple[Any, StubController],
                                                                     probe_reaches: bool) -> None:
    sim, stub = paired
    node = sim.model.slots["rollout-1"].node
    last = sim.now - 30.0
    jitter = [0.01 * ((i * 7) % 5 - 2) for i in range(observe.HEARTBEAT_HISTORY)]
    for detector in (stub.detector, sim.detector):
        observe.prime_heartbeats(detector, node, last, 1.0, jitter)
    all_quiet(stub)
    stub.model.nodes[node].last_heartbeat_at = last
    live_tick(stub)  # no probe yet: suspect
    [sim_first] = sim_judges(sim, node, last).suspects
    assert sim_first.verdict == "suspect"
    for model in (stub.model, sim.model):
        assert model.nodes[node].life.state.value == "suspect"
    detail = "probe said so"
    stub.detection.probes[node] = (probe_reaches, detail, stub.now)
    live_tick(stub)
    assert len(sim_judges(sim, node, last, ProbeAnswer(probe_reaches, detail, sim.now)).verdicts) == 1
    live = [v for v in live_verdicts(stub) if v["node"] == node]
    assert [comparable(v) for v in live] == [comparable(v) for v in sim_side(sim)[0]]
    assert stub.plans == sim_side(sim)[1]


@pytest.mark.parametrize("phase", ["generating", "waiting-for-work"])
def test_frozen_progress_gives_the_same_hang_verdict(paired: tuple[Any, StubController], phase: str) -> None:
    sim, stub = paired
    slot_name = "rollout-0"
    all_quiet(stub)
    for model in (stub.model, sim.model):
        slot = model.slots[slot_name]
        model.apply(event("WorkerPhase", stub.now - 60.0, slot=slot_name, wid=slot.wid, phase=phase, step=1))
        slot.progress_at = stub.now - 60.0
    stub.last_request_at[stub.model.slots[slot_name].wid] = stub.now - 60.0
    for _ in range(WORKER_CHECK_SLICES):  # one whole round of worker judgements
        live_tick(stub)
    slot = sim.model.slots[slot_name]
    obs = observe.worker_obs(slot, phase, slot.progress, 60.0, request_age_s=60.0)
    [verdict] = sim.orc.reconcile(sim.now, Observations(workers=WorkerSightings(judged=(obs,)))).verdicts
    assert verdict.fault == "worker-hang"
    live = [v for v in live_verdicts(stub) if v["slot"] == slot_name]
    assert [comparable(v)[:5] for v in live] == [comparable(v)[:5] for v in sim_side(sim)[0]]
    assert stub.plans == sim_side(sim)[1]


def test_a_real_chaos_journal_replays_to_the_plans_it_journaled() -> None:
    """For every verdict of a real local run (rollout and trainer crashes), the plan re-derived from the
    model as it stood is the sequence of actions the live controller journaled for that fault."""
    events = read_events(DATA / "chaos_journal.jsonl")
    spec = load_job_file(DATA / "chaos_job.toml")
    model = JobModel(job_id="chaos")
    checked = 0
    for index, ev in enumerate(events):
        if ev.type == "Verdict" and ev.data["verdict"] == "failed":
            verdict = det.Verdict(ev.data["node"], ev.data["slot"], ev.data["verdict"], ev.data["fault_kind"],
                                  ev.data["action"], ev.data["reason"], ev.data["evidence_since"])
            steps = policy.plan(copy.deepcopy(model), verdict, spec.fault_tolerance.max_restarts_per_slot)
            journaled = [e.data["action"] for e in events[index + 1:]
                         if e.type == "ActionTaken" and ev.data["fault"] in e.data.get("fault_ids", [])]
            assert [s.kind for s in steps] == journaled[: len(steps)]
            checked += 1
        model.apply(ev)
    assert checked >= 2


def test_the_sim_events_replay_to_the_same_model(quickstart: Any) -> None:
    """What the simulator journals rebuilds its model exactly, as a controller's journal does."""
    sim = paused_simulation(quickstart, PAUSE_S)
    replayed = replayed_model(sim.events)
    assert replayed.ledger.seconds == pytest.approx(sim.model.ledger.seconds)
    assert replayed.published_version == sim.model.published_version
    assert {k: v.life.state for k, v in replayed.nodes.items()} == {k: v.life.state for k, v in sim.model.nodes.items()}
    assert json.dumps(sorted(replayed.slots)) == json.dumps(sorted(sim.model.slots))


# ---- rounds, held-out evaluations and the finish -------------------------------------------------

DECISION_TYPES = ("EpochStarted", "RoundStarted", "HeldOutStarted")
TRACE_STEPS = 6


def with_held_out(spec: Any) -> Any:
    """The job with held-out prompts evaluated every second version (the simulator makes them up)."""
    return dataclasses.replace(spec, raw={**spec.raw, "data": {
        **spec.raw["data"], "eval_files": ["held_out.parquet"], "eval_every": 2, "eval_max_prompts": 8}})


def test_rounds_held_out_evaluations_and_the_finish_are_decided_the_same_live_and_simulated(quickstart: Any) -> None:
    """A simulated job's whole event sequence is fed, moment by moment, to the live controller's
    tick (its detection observing, the core deciding, the detection carrying out). At every moment
    the simulator opened a round or an epoch, started a held-out evaluation or finished the job, the
    live tick, given everything journaled before it, decides the same: the same events with the
    same data (prompts, versions, kinds, sizes), and the same stop."""
    spec = with_held_out(quickstart)
    config = SimConfig(policy="role", steps=TRACE_STEPS, record_events=True)
    pristine = Simulation(spec, CostModel(), TraceFailures([]), config)
    sim = Simulation(spec, CostModel(), TraceFailures([]), config)
    sim.run()
    events = sim.events
    final = [e for e in events if e.type == "JobStateChanged" and e.data["state"] == "succeeded"]
    assert final, "the simulated job should succeed"
    moments = sorted({e.at for e in events if e.type in DECISION_TYPES} | {final[0].at})
    compared = {"RoundStarted": 0, "HeldOutStarted": 0, "EpochStarted": 0, "finish": 0}
    for at in moments:
        before = [e for e in events if e.at < at or (e.at == at and e.type not in DECISION_TYPES
                                                       and e.type != "JobStateChanged")]
        simulated = [e for e in events if e.at == at and e.type in DECISION_TYPES]
        model = replayed_model_with(before, copy.deepcopy(pristine.scheduler))
        stub = StubController(model, spec, observe.detector_for(spec), at)
        all_quiet(stub)
        decisions = stub.orc.reconcile(at, stub.detection.observe(at, stopping=False))
        stub.detection.carry_out(decisions)
        live = [e for e in stub.recorded if e.type in DECISION_TYPES]
        assert [(e.type, e.data) for e in live] == [(e.type, e.data) for e in simulated], f"at {at:.1f} s"
        for e in simulated:
            compared[e.type] += 1
        if at == final[0].at:
            assert decisions.stop is not None and decisions.stop.succeeded
            assert decisions.stop.reason == final[0].data["reason"]
            compared["finish"] += 1
        else:
            assert decisions.stop is None, f"the live tick stopped the job at {at:.1f} s"
    assert compared["RoundStarted"] >= TRACE_STEPS and compared["HeldOutStarted"] == TRACE_STEPS // 2 + 1
    assert compared["EpochStarted"] >= 1 and compared["finish"] == 1


def replayed_model_with(events: list[Event], scheduler: Any) -> JobModel:
    """The model (and its round scheduler) a controller rebuilds from ``events``, as on resume."""
    model = JobModel(job_id="replayed")
    model.scheduler = scheduler
    for ev in events:
        model.apply(ev)
    return model
