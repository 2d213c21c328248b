"""The tick: everything a job decides at one moment, for the live controller and the simulator.

``Tick.decide(model, rounds, now, seen)`` is the reconcile step, in the style of Ray autoscaler
v2's reconciler: from the job's model and typed observations (``Observations``: node sightings with
their heartbeats and probe answers, the workers' progress and phases, how late the observer is) it
returns ``TickDecisions``: the events to journal (a round or a held-out evaluation opening, faults
that healed unseen, a stall), the nodes to suspect and probe, the verdicts for recovery, and
whether the job stops. It owns every decision of the moment:

- the round, the held-out evaluation and the finish (``core.job_moves``), and the end of a job
  whose round dynamic sampling can never fill (``RoundScheduler.unfillable``);
- the faults that healed before any verdict saw them;
- node judging with its probe, the all-quiet hold, the resume grace and the startup bound
  (``core.node_judging``);
- worker judging: a frozen or over-bound worker alone, fail-slow against its role's peers
  (``core.detector``);
- the stall guard (``core.stall``).

``Orchestrator.carry_out`` applies the decisions through the core (journal, suspect, recover); the
shell is left with what touches the world: probing a node and stopping the job. The controller
calls the tick every 100 ms with everything it observed; the simulator calls it at the moments its
virtual clock makes something observable, with only what became observable then (the nodes and
workers whose judgement falls due), so thousands of nodes cost nothing while they beat.

The detector's φ-accrual history, the startup clocks and the stall guard's mark are the tick's
own state; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from rlctl.core import detector as det
from rlctl.core import job_moves as moves
from rlctl.core.event_payloads import FaultRecoveredData
from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.node_judging import NodeJudge, NodeSightings
from rlctl.core.rounds import RoundScheduler
from rlctl.core.stall import StallGuard
from rlctl.core.states import JobState

MOVING_STATES = (JobState.RUNNING, JobState.RECOVERING)


@dataclass(frozen=True)
class WorkerSightings:
    """Workers observed at this moment: ``judged`` one by one (a hang, a bound on progress or on a
    request); ``peers``, when given, a complete set of running workers compared with each other for
    fail-slow, with their progress ``rates`` (None: the detector's own)."""

    judged: tuple[det.WorkerObs, ...] = ()
    peers: tuple[det.WorkerObs, ...] | None = None
    rates: Mapping[str, float | None] | None = None


@dataclass(frozen=True)
class Observations:
    """What the shell observed at this moment.

    ``nodes``: the heartbeat sightings (None: no node is judged now); ``judged_nodes``: judge only
    these (None: every node in a judged state); ``lag_s``: how late the observer's own loop ran;
    ``resume_grace``: a resumed controller still waits for the agents to come back; ``stopping``:
    the job is being stopped (nothing moves forward, nothing is judged)."""

    nodes: NodeSightings | None = None
    judged_nodes: Collection[str] | None = None
    workers: WorkerSightings = field(default_factory=WorkerSightings)
    lag_s: float = 0.0
    resume_grace: bool = False
    stopping: bool = False


@dataclass(frozen=True)
class JobStop:
    """The job ends: ``reason`` for the operator, ``succeeded`` for its final state."""

    reason: str
    succeeded: bool
    stalled_since: float | None = None  # a stall: when the last progress was seen


@dataclass
class TickDecisions:
    """What one moment decided. ``events`` are journaled in order before anything else is done;
    ``opened_round`` is the version whose round they open (the simulator starts generating it);
    ``suspects`` are marked suspect and probed; ``verdicts`` go to recovery; ``all_quiet`` (None when
    no node was judged) says every node went quiet at once and their verdicts are held."""

    events: list[Event] = field(default_factory=list)
    opened_round: int | None = None
    suspects: list[det.Verdict] = field(default_factory=list)
    verdicts: list[det.Verdict] = field(default_factory=list)
    all_quiet: bool | None = None
    stop: JobStop | None = None


@dataclass
class Tick:
    """The reconcile step with the state its judgements keep between moments."""

    judge: NodeJudge
    stall: StallGuard

    @property
    def detector(self) -> det.Detector:
        return self.judge.detector

    def decide(self, model: JobModel, rounds: RoundScheduler, now: float, seen: Observations) -> TickDecisions:
        out = TickDecisions()
        if seen.stopping:
            return out
        if model.life.state in MOVING_STATES:
            self._move(model, rounds, now, out)
            out.events += [Event.of(now, FaultRecoveredData(fault_ids=[f.fault_id], slot=f.slot, node=f.node))
                           for f in model.healed_unseen(now)]
            self._judge_nodes(model, now, seen, out)
            if not seen.resume_grace:  # workers blocked on requests while the controller was down are not hung
                self._judge_workers(model, now, seen.workers, out)
        if model.life.state == JobState.STARTING:
            out.verdicts += self.judge.startup(model, now)
        if out.stop is None and not out.verdicts and (stalled := self.stall.check(model, now)) is not None:
            # A verdict of this moment moves the progress mark once journaled: no stall is judged beside it.
            out.events += stalled.events
            out.stop = JobStop(stalled.reason, False, self.stall.since)
        return out

    @staticmethod
    def _move(model: JobModel, rounds: RoundScheduler, now: float, out: TickDecisions) -> None:
        """Open the round that is due, start the held-out evaluation that is due, or finish."""
        if (version := moves.round_due(model, rounds)) is not None:
            out.events += rounds.start_round(version, now)
            out.opened_round = version
        if (version := moves.held_out_due(model, rounds)) is not None:
            out.events += rounds.start_held_out(version, now)
        if moves.finished(model, rounds):
            out.stop = JobStop("all steps done", True)
        elif (unfillable := rounds.unfillable()) is not None:
            out.stop = JobStop(unfillable, False)  # dynamic sampling cannot fill the batch (verl's DAPO raises)

    def _judge_nodes(self, model: JobModel, now: float, seen: Observations, out: TickDecisions) -> None:
        if seen.nodes is None:
            return
        judgement = self.judge.judge(model, seen.nodes, now, seen.lag_s, seen.resume_grace)
        wanted = seen.judged_nodes
        out.all_quiet = judgement.all_quiet
        out.suspects += [v for v in judgement.suspects if wanted is None or v.node in wanted]
        out.verdicts += [v for v in judgement.verdicts if wanted is None or v.node in wanted]

    def _judge_workers(self, model: JobModel, now: float, workers: WorkerSightings, out: TickDecisions) -> None:
        detector = self.detector
        for obs in workers.judged:
            if (verdict := detector.worker_verdict(obs, now)) is not None:
                out.verdicts.append(verdict)
        if workers.peers is not None:
            # A worker replaced while its peers were gathered is compared next time, under its new id.
            current = [obs for obs in workers.peers if (slot := model.slots.get(obs.slot)) is not None
                       and slot.wid == obs.wid]
            out.verdicts += detector.slow_verdicts(current, now, rates=workers.rates)
