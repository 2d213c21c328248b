"""The tick (``rlctl.core.tick``): what one moment decides from the model and typed observations,
the same for the live controller and the simulator. Each decision of the moment, and how they
bear on each other: a stopping job decides nothing, a verdict holds the stall guard back, a node
outside ``judged_nodes`` is not judged, a worker replaced while its peers were gathered is not
compared, the resume grace holds worker judging."""

from __future__ import annotations

from rlctl.core import detector as det
from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads import FaultInjectedData, WeightsPublishedData
from rlctl.core.events import Event, event
from rlctl.core.model import JobModel
from rlctl.core.node_judging import NodeJudge, NodeSighting, ProbeAnswer, SightingTable
from rlctl.core.rounds import RoundScheduler
from rlctl.core.stall import StallGuard
from rlctl.core.tick import Observations, Tick, WorkerSightings
from tests.core.test_policy import running_job
from tests.core.test_rounds import make_scheduler

CONFIG = det.DetectorConfig(heartbeat_interval_s=1.0, phi_threshold=8.0, min_silence_s=3.0, confirm_with_probe=True,
                            phase_timeout_s={"generating": 30.0}, slow_ratio=0.5, slow_window_s=10.0)


def job(stall_s: float = 0.0, published: int | None = 0) -> tuple[JobModel, RoundScheduler, Tick]:
    model = running_job(spares=0)
    for state in ("starting", "running"):
        model.apply(event(EventKind.JOB_STATE_CHANGED, 2.0, state=state, reason="test"))
    if published is not None:
        model.apply(Event.of(3.0, WeightsPublishedData(version=published, slot="trainer-0", source={"checksum": "c"})))
    scheduler = make_scheduler(tail=False)
    model.scheduler = scheduler
    return model, scheduler, Tick(NodeJudge(det.Detector(CONFIG), CONFIG.min_silence_s), StallGuard(stall_s))


def beating(model: JobModel, now: float, silent: dict[str, float] | None = None) -> SightingTable:
    silent = silent or {}
    return SightingTable({name: NodeSighting(name, silent.get(name, now), name not in silent) for name in model.nodes})


def test_a_moment_opens_the_due_round_once_the_first_weights_exist() -> None:
    model, rounds, tick = job(published=None)
    assert tick.decide(model, rounds, 10.0, Observations()).opened_round is None
    model.apply(Event.of(11.0, WeightsPublishedData(version=0, slot="trainer-0", source={"checksum": "c"})))
    decisions = tick.decide(model, rounds, 12.0, Observations())
    assert decisions.opened_round == 0 and decisions.events[-1].type == EventKind.ROUND_STARTED
    assert decisions.stop is None and decisions.all_quiet is None and not decisions.verdicts


def test_the_last_version_finishes_the_job_and_a_stopping_job_decides_nothing() -> None:
    model, rounds, tick = job(published=None)
    model.apply(Event.of(3.0, WeightsPublishedData(version=model.total_steps, slot="trainer-0", source={})))
    assert tick.decide(model, rounds, 10.0, Observations(stopping=True)).stop is None
    stop = tick.decide(model, rounds, 10.0, Observations()).stop
    assert stop is not None and stop.succeeded and stop.reason == "all steps done"


def test_a_fault_that_healed_unseen_is_ended_by_the_moment_its_duration_does() -> None:
    model, rounds, tick = job()
    model.apply(Event.of(10.0, FaultInjectedData(fault_id="f1", node="node02", kind="slow",
                                                 params={"duration": 5.0, "factor": 3.0})))
    assert not [e for e in tick.decide(model, rounds, 14.0, Observations()).events
                if e.type == EventKind.FAULT_RECOVERED]
    [healed] = [e for e in tick.decide(model, rounds, 15.0, Observations()).events
                if e.type == EventKind.FAULT_RECOVERED]
    assert healed.data["fault_ids"] == ["f1"]


def test_a_silent_node_is_suspected_then_convicted_on_the_probe_only_where_it_is_judged() -> None:
    model, rounds, tick = job()
    for at in range(30):
        tick.detector.heartbeat("node02", float(at))
    silent = beating(model, 60.0, {"node02": 29.0})
    assert not tick.decide(model, rounds, 60.0, Observations(nodes=silent, judged_nodes=("node03",))).suspects
    decisions = tick.decide(model, rounds, 60.0, Observations(nodes=silent))
    assert [(v.node, v.verdict) for v in decisions.suspects] == [("node02", "suspect")] and decisions.all_quiet is False
    probed = SightingTable({**silent.by_node, "node02": NodeSighting("node02", 29.0, False,
                                                                     ProbeAnswer(False, "probe timed out", 60.5))})
    [verdict] = tick.decide(model, rounds, 61.0, Observations(nodes=probed)).verdicts
    assert (verdict.node, verdict.verdict, verdict.action) == ("node02", "failed", "replace-node")


def test_a_verdict_holds_the_stall_guard_back_in_its_own_moment() -> None:
    model, rounds, tick = job(stall_s=30.0)
    assert tick.decide(model, rounds, 10.0, Observations()).stop is None  # the mark is first seen
    hung = det.WorkerObs("rollout-0", model.slots["rollout-0"].wid or "", "rollout", "node02", "generating", 1.0, 60.0,
                         request_age_s=60.0)
    decisions = tick.decide(model, rounds, 45.0, Observations(workers=WorkerSightings(judged=(hung,))))
    assert [v.fault for v in decisions.verdicts] == ["worker-hang"] and decisions.stop is None
    stalled = tick.decide(model, rounds, 45.0, Observations()).stop
    assert stalled is not None and not stalled.succeeded and stalled.stalled_since == 10.0
    assert "stalled" in stalled.reason and "stall_s = 30" in stalled.reason


def test_workers_are_not_judged_in_the_resume_grace_and_a_replaced_peer_is_not_compared() -> None:
    model, rounds, tick = job()
    wid = model.slots["rollout-0"].wid or ""
    hung = det.WorkerObs("rollout-0", wid, "rollout", "node02", "generating", 1.0, 60.0, request_age_s=60.0)
    assert not tick.decide(model, rounds, 70.0, Observations(workers=WorkerSightings(judged=(hung,)),
                                                              resume_grace=True)).verdicts
    peers = tuple(det.WorkerObs(slot, model.slots[slot].wid or "", "rollout", node, "generating", 0.0, 0.0)
                  for slot, node in (("rollout-0", "node02"), ("rollout-1", "node03")))
    verdicts: list[det.Verdict] = []
    for second in range(70, 90):  # rollout-0 makes a tenth of its peer's progress
        for obs, speed in zip(peers, (1.0, 10.0), strict=True):
            tick.detector.progress(obs.wid, second * speed, float(second))
        stale = (det.WorkerObs("rollout-0", "an-older-worker", "rollout", "node02", "generating", 0.0, 0.0), peers[1])
        assert not tick.decide(model, rounds, float(second), Observations(workers=WorkerSightings(peers=stale))).verdicts
        verdicts += tick.decide(model, rounds, float(second), Observations(workers=WorkerSightings(peers=peers))).verdicts
    assert verdicts and {(v.slot, v.fault) for v in verdicts} == {("rollout-0", "fail-slow")}  # again each moment
