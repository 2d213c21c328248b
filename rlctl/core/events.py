"""Typed events: every fact the controller learns or decides, with a schema version.

The journal stores events; the job model is rebuilt by applying them in order, so the live
controller, a resumed controller, `status`, `report` and the tests all read the same truth.
Pure: timestamps are given by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

EVENT_SCHEMA_VERSION = 1

# Every event type the journal may hold, with the data keys it must carry.
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    "JobSubmitted": ("job_id", "spec_file", "backend", "policy"),
    "JobStateChanged": ("state", "reason"),
    "NodeAllocated": ("node", "host", "role", "slot"),
    "NodeStateChanged": ("node", "state", "reason"),
    "AgentRegistered": ("node", "incarnation", "facts"),
    "AgentDisconnected": ("node", "reason"),
    "HeartbeatSummary": ("beats", "nodes", "window_s"),
    "WorkerStarting": ("slot", "wid", "node", "role"),
    "WorkerStarted": ("slot", "wid", "pid"),
    "WorkerPhase": ("slot", "wid", "phase", "step"),
    "WorkerExited": ("slot", "wid", "exit_code", "signal"),
    "FaultInjected": ("fault_id", "node", "kind", "params"),
    "FaultSignal": ("node", "kind", "detail"),
    "Verdict": ("node", "slot", "verdict", "fault", "reason"),
    "ActionTaken": ("action", "node", "slot", "reason"),
    "FaultRecovered": ("fault_ids", "slot", "node"),
    "RoundStarted": ("step", "kind", "weights_version", "max_new_tokens", "prompts", "target_groups"),
    "ItemsDispatched": ("slot", "wid", "item_ids"),
    "ItemsReturned": ("item_ids", "reason"),
    "TrajectoryStored": ("item_id", "response_tokens", "truncated", "weights_version", "slot"),
    "PromptDeferred": ("prompt_id", "step"),
    "RewardsStored": ("scores",),
    "RewardFunctionFailed": ("function", "item_id", "prompt_id", "error", "on_error"),
    "ScoringDispatched": ("slot", "wid", "item_ids"),
    "BatchFormed": ("step", "kind", "prompt_ids", "returned_prompt_ids"),
    "EpochStarted": ("epoch", "order"),
    "WeightsPublished": ("version", "slot", "source"),
    "WeightsHeld": ("version", "slot", "source"),
    "WeightsSourceFailed": ("version", "source", "reporter", "error"),
    "StepTrained": ("step", "metrics"),
    "Checkpointed": ("step", "path"),
    "TrainerRestored": ("slot", "checkpoint_step", "replayed_steps"),
    "ControllerStarted": ("pid", "resumed"),
    "SchedulerRolledBack": ("to_step",),
    "HeldOutStarted": ("version", "prompts", "max_new_tokens"),
    "HeldOutScored": ("version", "prompts", "reward_mean", "reward_std_err", "accuracy"),
}


class EventError(ValueError):
    """An event of an unknown type, or missing a key its type requires."""


@dataclass(frozen=True)
class Event:
    """One fact. ``seq`` is assigned by the journal; ``at`` is controller wall time (seconds)."""

    type: str
    at: float
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0

    def __post_init__(self) -> None:
        required = EVENT_TYPES.get(self.type)
        if required is None:
            raise EventError(f"unknown event type {self.type!r}")
        missing = [key for key in required if key not in self.data]
        if missing:
            raise EventError(f"event {self.type} lacks {', '.join(missing)}")

    def to_json(self) -> str:
        return json.dumps({"v": EVENT_SCHEMA_VERSION, "data": self.data}, separators=(",", ":"))

    @classmethod
    def from_row(cls, seq: int, type_: str, at: float, payload: str) -> Event:
        body = json.loads(payload)
        if body.get("v") != EVENT_SCHEMA_VERSION:
            raise EventError(f"event {seq} has schema version {body.get('v')!r}, expected {EVENT_SCHEMA_VERSION}")
        return cls(type=type_, at=at, data=body["data"], seq=seq)

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": self.at, "data": self.data}


def event(type_: str, at: float, **data: Any) -> Event:
    """Shorthand constructor: ``event("Verdict", now, node=..., ...)``."""
    return Event(type=type_, at=at, data=data)
