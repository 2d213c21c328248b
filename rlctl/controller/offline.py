"""Stopping a job whose controller is dead: through the backend, with the stop journaled.

``rlctl stop`` normally asks the job's controller. When no controller answers, this takes the
journal over (which fences a controller that is only paused or cut off), rebuilds the job's model,
releases every node through the backend (local processes killed, ``scancel``, or SSH to each host
to stop its agent and workers), and journals what the controller would have: the workers stopped,
the nodes released, the job ``stopped``. Nothing can ask the trainer for a stop checkpoint (it
talks to the job only through the controller): a ``StopCheckpoint`` event says so, with the last
checkpoint and the steps trained since that are lost. The decisions are the orchestration core's own
(``Orchestrator.stop_worker``, ``release_events_for_end``, ``end``); this module is their shell
when there is no controller.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rlctl.backends.base import Backend, BackendError, NodeInfo
from rlctl.controller.jobdir import JobDir
from rlctl.controller.predecessor import JournalHeld, take_write_lock
from rlctl.controller.stopsave import tidy_checkpoints
from rlctl.controller.store import Journal
from rlctl.core import detector as det
from rlctl.core import effects as fx
from rlctl.core.event_payloads import JobStateChangedData, StopCheckpointData, WorkerExitedData
from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.orchestrate import LIVE_WORKER, Orchestrator
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState
from rlctl.core.stopsave import StopSaveOutcome, StopSavePlan, outcome_data

log = logging.getLogger("rlctl.controller.offline")


class OfflineStopError(RuntimeError):
    """The backend could not release the job's nodes (the message says which and why)."""


@dataclass(frozen=True)
class OfflineStop:
    state: str
    step: int
    nodes_released: int
    workers_stopped: int
    already_ended: bool
    checkpoint: dict[str, object] | None = None  # the StopCheckpoint event's data (None: the job had ended)


class JournalShell:
    """The core's shell with nothing running: a clock and the journal, no agents, no plans."""

    def __init__(self, journal: Journal, model: JobModel) -> None:
        self.journal = journal
        self.model = model

    def clock(self) -> float:
        return time.time()

    def commit(self, events: list[Event]) -> list[Event]:
        stored = self.journal.append(events)
        for ev in stored:
            self.model.apply(ev)
        return stored

    def connected(self, node: str) -> bool:
        return False

    def run_plan(self, plan: fx.Plan) -> None:
        raise RuntimeError("no controller runs: a recovery plan cannot be carried out while stopping offline")


async def stop_offline(jobdir: JobDir, spec: JobSpec, backend: Backend, reason: str) -> OfflineStop:
    """Stop the job through ``backend``; journal it. Safe to repeat (an ended job is left alone)."""
    journal = Journal(jobdir.journal)
    job_id = jobdir.job_id
    try:
        try:
            take_write_lock(journal, jobdir.read_controller())
        except JournalHeld as exc:
            raise OfflineStopError(str(exc)) from exc
        journal.take_over()
        model = JobModel(job_id=job_id)
        scheduler = RoundScheduler(config_from_spec(spec), [])
        model.scheduler = scheduler
        for ev in journal.read():
            model.apply(ev)
        if model.life.state.terminal:
            return OfflineStop(model.life.state.value, model.step, 0, 0, already_ended=True)
        shell = JournalShell(journal, model)
        orc = Orchestrator(spec, model, scheduler, det.Detector(det.config_from_spec(spec.fault_tolerance)), shell)
        if model.life.can_move(JobState.STOPPING):
            orc.record(JobStateChangedData(state=JobState.STOPPING.value, reason=reason))
        stopping = [slot for slot in model.slots.values() if slot.life is not None and slot.life.state in LIVE_WORKER]
        stops = [stop for slot in stopping if (stop := orc.stop_worker(slot)) is not None]
        live = [NodeInfo(name=n.name, host=n.host, backend_ref=n.backend_ref)
                for n in model.nodes.values() if n.life.state != NodeState.RELEASED]
        try:
            await backend.adopt(live)
            await backend.release(live)
        except BackendError as exc:
            raise OfflineStopError(str(exc)) from exc
        for stop in stops:
            orc.record(WorkerExitedData(slot=stop.slot, wid=stop.wid, exit_code=None, signal="SIGKILL",
                                        reason="stopped with the job (no controller ran)"))
        tidy_checkpoints(jobdir.checkpoints)
        unsaved = StopSavePlan(False, model.published_version, model.checkpoint_step, 0.0, "")
        saved = outcome_data(StopSaveOutcome.NO_CONTROLLER, unsaved, model.checkpoint_step, 0.0,
                             "the controller is gone, and only it can ask the trainer to save")
        orc.record(StopCheckpointData(**saved))
        orc.release_events_for_end()
        orc.end(JobState.STOPPED, reason)
        log.info("stopped %s offline: %d node(s) released, %d worker(s) stopped", job_id, len(live), len(stops))
        return OfflineStop(model.life.state.value, model.step, len(live), len(stops), already_ended=False,
                           checkpoint=saved)
    finally:
        await backend.close()
        journal.close()
