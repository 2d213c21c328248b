"""The stop checkpoint: what an operator's stop saves before the trainer is stopped. Pure.

``rlctl stop JOB`` asks the live trainer to checkpoint the version it holds before the controller
stops it, and waits for that (bounded by a timeout) before the workers are stopped; ``--now``
skips it. ``plan_stop_save`` decides whether there is a trainer to ask, ``leader_alive`` and
``leader_hung`` whether it can still answer, ``outcome_data`` and ``describe`` say how the wait
ended (the journal's ``StopCheckpoint`` event and the CLI's sentence), ``keeps_serving``
decides which trainer requests still get data while the job stops (every rank of a trainer group
must train the same steps, or the group's checkpoint collectives would not meet; a restarted trainer
may still replay up to the published version).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rlctl.core import detector as det
from rlctl.core.model import JobModel
from rlctl.core.recovery import LIVE_WORKER
from rlctl.core.states import WorkerState

LEADER_SLOT = "trainer-0"  # rank 0 writes the checkpoint folder and reports (rlctl.roles.trainer)


class StopSaveOutcome(StrEnum):
    """How the stop checkpoint ended; journaled as ``StopCheckpoint.outcome``."""

    WRITTEN = "written"  # the trainer wrote a checkpoint of the version it held
    ALREADY_SAVED = "already-saved"  # the version it held was checkpointed already
    FAILED = "failed"  # the trainer tried and the write failed (the previous checkpoint stays)
    TIMED_OUT = "timed-out"  # no answer within the timeout; the trainer was stopped anyway
    TRAINER_LOST = "trainer-lost"  # the trainer's worker or node went away before it answered
    CANCELLED = "cancelled"  # `rlctl stop --now` while the trainer was saving
    SKIPPED = "skipped"  # not asked: --now, no live trainer, nothing trained yet
    NO_CONTROLLER = "no-controller"  # the controller was gone: nobody could ask the trainer

    @property
    def saved(self) -> bool:
        return self in (StopSaveOutcome.WRITTEN, StopSaveOutcome.ALREADY_SAVED)


@dataclass(frozen=True)
class StopSavePlan:
    """What a stop asks of the trainer. ``wait``: ask the live trainer to checkpoint and wait up to
    ``timeout_s`` for its answer; otherwise ``reason`` says why nothing is asked. ``step``: the
    published version when the stop was asked (the trainer may still finish the step it is on)."""

    wait: bool
    step: int
    checkpoint_step: int
    timeout_s: float
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "step": self.step, "checkpoint_step": self.checkpoint_step,
                "timeout_s": self.timeout_s, "reason": self.reason}


def plan_stop_save(model: JobModel, checkpoint: bool, timeout_s: float) -> StopSavePlan:
    """Whether the operator's stop asks the trainer for a checkpoint first (``checkpoint`` False:
    ``--now``). Every trainer rank must be live: a group saves together or not at all."""
    step, saved = model.published_version, model.checkpoint_step

    def skip(reason: str) -> StopSavePlan:
        return StopSavePlan(False, step, saved, timeout_s, reason)

    if not checkpoint:
        return skip("--now: the stop writes no checkpoint")
    ranks = [s for s in model.slots_of("trainer") if s.node is not None]
    if not ranks:
        return skip("the job has no trainer placed yet")
    down = [s.slot for s in ranks if s.life is None or s.life.state not in LIVE_WORKER]
    if down:
        return skip(f"no whole trainer runs to save it (not running: {', '.join(sorted(down))})")
    if step <= 0 and not any(s.phase == "training" for s in ranks):
        return skip("no step was trained yet")
    return StopSavePlan(True, step, saved, timeout_s, f"the trainer saves its current version (step {step} or the "
                                                       f"step it is finishing), up to {timeout_s:g} s")


def leader_alive(model: JobModel, connected: bool) -> bool:
    """Whether the trainer rank that writes the folder can still answer (its node's agent
    ``connected``, its worker live)."""
    slot = model.slots.get(LEADER_SLOT)
    return (connected and slot is not None and slot.life is not None and slot.life.state in LIVE_WORKER
            and slot.life.state != WorkerState.SUSPECT)


def leader_hung(model: JobModel, detector: det.Detector, asked_at: float | None, now: float) -> str:
    """Why the rank that writes the stop checkpoint is hung by the detector's own rule (progress
    frozen past its phase's bound, or its polls stopped; ``asked_at``: its last call to the
    controller), '' when it is not. The stop does not wait out its timeout on a frozen trainer."""
    slot = model.slots.get(LEADER_SLOT)
    if slot is None or slot.node is None or slot.wid is None or slot.life is None \
            or slot.life.state != WorkerState.RUNNING:
        return ""
    since = max(asked_at or 0.0, slot.phase_since)
    observed = det.WorkerObs(slot.slot, slot.wid, slot.role, slot.node, slot.phase, slot.progress,
                             max(0.0, now - slot.progress_at), request_age_s=max(0.0, now - since))
    verdict = detector.worker_verdict(observed, now)
    return verdict.reason if verdict is not None else ""


def outcome_data(outcome: StopSaveOutcome, plan: StopSavePlan, checkpoint_step: int, seconds: float,
                 reason: str, **extra: Any) -> dict[str, Any]:
    """The ``StopCheckpoint`` event's data: ``step`` the version saved (or that the stop meant to
    save), ``checkpoint_step`` the newest checkpoint after it, ``seconds`` the wait."""
    return {"outcome": outcome.value, "step": extra.pop("step", plan.step), "checkpoint_step": checkpoint_step,
            "seconds": round(seconds, 3), "timeout_s": plan.timeout_s, "reason": reason, **extra}


def describe(data: dict[str, Any]) -> str:
    """One sentence for the operator from a ``StopCheckpoint`` event's data."""
    outcome = StopSaveOutcome(str(data["outcome"]))
    step, last = int(data["step"]), int(data["checkpoint_step"])
    last_text = f"last checkpoint is step {last}" if last >= 0 else "the job has no checkpoint"
    first_unsaved = max(last, 0) + 1
    lost = ("" if step < first_unsaved else f"; step {step} is not saved" if step == first_unsaved
            else f"; steps {first_unsaved}-{step} are not saved")
    if outcome == StopSaveOutcome.WRITTEN:
        return f"checkpoint of step {step} written in {float(data['seconds']):.1f} s"
    if outcome == StopSaveOutcome.ALREADY_SAVED:
        return f"step {step} was already checkpointed; nothing more to save"
    return f"no checkpoint written: {data['reason']}; {last_text}{lost}"


def keeps_serving(step: int, have: int, served: int, published: int) -> bool:
    """While the job stops, whether a trainer rank's request for the part of ``step``'s batch from
    group ``have`` is still answered with data: a step below the ``published`` version (a restarted
    trainer replaying retained batches up to what was trained, which the stop checkpoint then
    keeps), or a part another rank of its group already got (``served``: the groups of that step
    handed out so far), so every rank trains the same steps and meets the others in the stop
    checkpoint. Any other request is answered with the stop."""
    return step < published or have < served
