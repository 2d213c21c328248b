"""The controller's side of the stop checkpoint: ask, wait (bounded), journal, tidy.

An operator's stop (``rlctl stop``, API op ``stop``) plans the stop checkpoint with
``core.stopsave.plan_stop_save``. While it is pending, the trainer's next ``trainer.get_batch``,
``trainer.get_stream`` or ``job.wait`` is answered ``{"stop": true, "checkpoint": true}``; the
trainer finishes the step it is on, writes the checkpoint of the version it holds (the same
atomic folder as every checkpoint) and answers ``trainer.stop_saved``. The controller's finish
waits for that answer, the trainer's loss, the timeout or ``rlctl stop --now``, whichever comes
first, journals one ``StopCheckpoint`` event saying which, and only then stops the workers. Once
every worker is stopped, ``tidy_checkpoints`` removes what a write killed half way left (a hidden
staged folder; a step folder is never half there).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlctl.core.checkpoint_names import leftover_of
from rlctl.core.event_payloads import EventPayload, StopCheckpointData
from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.stopsave import LEADER_SLOT, StopSaveOutcome, StopSavePlan, leader_alive, outcome_data

log = logging.getLogger("rlctl.controller.stopsave")

POLL_S = 0.1


class StopSave:
    """One job's stop checkpoint. ``record`` journals an event; ``connected(node)`` says whether a
    node's agent is connected; ``hung(now)`` why the trainer is hung ('' when it is not:
    ``core.stopsave.leader_hung``); ``clock`` is the time the wait is measured on (the ``now``
    given to ``begin``). Not thread-safe: used on the controller's event loop."""

    def __init__(self, model: JobModel, record: Callable[[EventPayload], list[Event]], connected: Callable[[str], bool],
                 hung: Callable[[float], str] = lambda now: "", clock: Callable[[], float] = time.time) -> None:
        self.model = model
        self.record = record
        self.connected = connected
        self.hung = hung
        self.clock = clock
        self.plan: StopSavePlan | None = None
        self.asked_at = 0.0
        self.result: dict[str, Any] | None = None  # the journaled StopCheckpoint data, once the wait ended
        self._cancelled = ""

    @property
    def pending(self) -> bool:
        """A trainer is being asked for the stop checkpoint and has not answered."""
        return self.plan is not None and self.plan.wait and self.result is None

    def begin(self, plan: StopSavePlan, now: float) -> None:
        """Start the stop checkpoint of an operator's stop; a plan that does not wait is journaled now."""
        self.plan, self.asked_at = plan, now
        if not plan.wait:
            self._end(StopSaveOutcome.SKIPPED, plan.reason, now)

    def cancel(self, reason: str) -> None:
        """`rlctl stop --now` while the trainer saves: stop waiting at once."""
        if self.pending:
            self._cancelled = reason

    def trainer_answered(self, args: dict[str, Any], now: float) -> None:
        """The trainer's ``trainer.stop_saved``: ``step`` it held, ``written``, ``write_s``, ``error``."""
        if not self.pending:
            return
        step, error = int(args.get("step", self.model.published_version)), str(args.get("error", ""))[:500]
        write_s = round(float(args.get("write_s", 0.0)), 3)
        if error:
            self._end(StopSaveOutcome.FAILED, f"the trainer could not write step {step}: {error}", now, step=step,
                      write_s=write_s)
        elif args.get("written"):
            self._end(StopSaveOutcome.WRITTEN, f"the trainer checkpointed step {step}", now, step=step, write_s=write_s,
                      path=self.model.checkpoint_path)
        else:
            self._end(StopSaveOutcome.ALREADY_SAVED, f"step {step} was checkpointed already", now, step=step)

    async def wait(self) -> dict[str, Any] | None:
        """Until the trainer answered, was lost, the timeout passed or the wait was cancelled; the
        journaled outcome (None when this stop planned no checkpoint)."""
        plan = self.plan
        if plan is None:
            return None
        while self.result is None:
            now = self.clock()
            if self._cancelled:
                self._end(StopSaveOutcome.CANCELLED, self._cancelled, now)
            elif now - self.asked_at >= plan.timeout_s:
                self._end(StopSaveOutcome.TIMED_OUT, f"the trainer did not save within {plan.timeout_s:g} s "
                          "(stop --timeout or [job] stop_checkpoint_timeout_s)", now)
            elif not self._leader_alive():
                self._end(StopSaveOutcome.TRAINER_LOST, "the trainer's worker or node went away before it saved", now)
            elif hung := self.hung(now):
                self._end(StopSaveOutcome.TRAINER_LOST, f"the trainer is hung ({hung})", now)
            else:
                await asyncio.sleep(POLL_S)
        return self.result

    def _leader_alive(self) -> bool:
        slot = self.model.slots.get(LEADER_SLOT)
        node = slot.node if slot is not None else None
        return leader_alive(self.model, node is not None and self.connected(node))

    def _end(self, outcome: StopSaveOutcome, reason: str, now: float, **extra: Any) -> None:
        assert self.plan is not None
        data = outcome_data(outcome, self.plan, self.model.checkpoint_step, max(0.0, now - self.asked_at), reason, **extra)
        self.record(StopCheckpointData(**data))
        self.result = data
        log.info("stop checkpoint: %s (%s)", outcome.value, reason)


def tidy_checkpoints(folder: Path) -> list[str]:
    """Remove the staged folders of checkpoint writes that were killed (no writer is left: every
    worker is stopped), and move a retired step folder back where a rewrite never replaced it.
    Returns what it did, one line each. A folder it cannot read is left alone."""
    done: list[str] = []
    try:
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return done
    for entry in entries:
        found = leftover_of(entry.name)
        if found is None or not entry.is_dir():
            continue
        step_folder, retired = found
        target = folder / step_folder
        try:
            if retired and not target.exists():
                entry.rename(target)
                done.append(f"restored {target.name} from {entry.name}")
            else:
                shutil.rmtree(entry)
                done.append(f"removed {entry.name}")
        except OSError as exc:
            log.warning("could not tidy %s: %s", entry, exc)
    for line in done:
        log.info("checkpoints: %s", line)
    return done
