"""A shell for the orchestration core in tests: it journals into a list (and applies to the model),
keeps the plans it is asked to run (``pending``) without running them, and has a clock the test moves."""

from __future__ import annotations

from rlctl.core.effects import Plan
from rlctl.core.events import Event
from rlctl.core.model import JobModel


class RecordingShell:
    def __init__(self, model: JobModel, now: float = 10.0) -> None:
        self.model, self.now = model, now
        self.journal: list[Event] = []
        self.pending: list[Plan] = []
        self.agents_connected = True

    def clock(self) -> float:
        return self.now

    def commit(self, events: list[Event]) -> list[Event]:
        for ev in events:
            self.model.apply(ev)
        self.journal.extend(events)
        return events

    def connected(self, node: str) -> bool:
        return self.agents_connected

    def run_plan(self, plan: Plan) -> None:
        self.pending.append(plan)
