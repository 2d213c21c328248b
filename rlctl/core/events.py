"""Typed events: every fact the controller learns or decides, with a schema version.

The journal stores events; the job model is rebuilt by applying them in order, so the live
controller, a resumed controller, `status`, `report` and the tests all read the same truth.
Pure: timestamps are given by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

EVENT_SCHEMA_VERSION = 1

class EventKind(StrEnum):
    """Every kind of event the journal may hold. A ``StrEnum``: a kind equals its name as a string,
    which is what the journal stores."""

    JOB_SUBMITTED = "JobSubmitted"
    JOB_STATE_CHANGED = "JobStateChanged"
    NODE_ALLOCATED = "NodeAllocated"
    NODE_STATE_CHANGED = "NodeStateChanged"
    AGENT_REGISTERED = "AgentRegistered"
    AGENT_DISCONNECTED = "AgentDisconnected"
    HEARTBEAT_SUMMARY = "HeartbeatSummary"
    WORKER_STARTING = "WorkerStarting"
    WORKER_STARTED = "WorkerStarted"
    WORKER_PHASE = "WorkerPhase"
    WORKER_EXITED = "WorkerExited"
    FAULT_INJECTED = "FaultInjected"
    FAULT_REFUSED = "FaultRefused"
    FAULT_SCHEDULED = "FaultScheduled"
    FAULT_ACCEPTED = "FaultAccepted"
    FAULT_CANCELLED = "FaultCancelled"
    FAULT_SIGNAL = "FaultSignal"
    VERDICT = "Verdict"
    ACTION_TAKEN = "ActionTaken"
    FAULT_RECOVERED = "FaultRecovered"
    ROUND_STARTED = "RoundStarted"
    ITEMS_DISPATCHED = "ItemsDispatched"
    ITEMS_RETURNED = "ItemsReturned"
    TRAJECTORY_STORED = "TrajectoryStored"
    PROMPT_DEFERRED = "PromptDeferred"
    REWARDS_STORED = "RewardsStored"
    REWARD_FUNCTION_FAILED = "RewardFunctionFailed"
    REWARD_FUNCTION_FAILING = "RewardFunctionFailing"
    REWARD_FUNCTION_RECOVERED = "RewardFunctionRecovered"
    ENV_FAILED = "EnvFailed"
    SCORING_DISPATCHED = "ScoringDispatched"
    BATCH_FORMED = "BatchFormed"
    EPOCH_STARTED = "EpochStarted"
    WEIGHTS_PUBLISHED = "WeightsPublished"
    WEIGHTS_HELD = "WeightsHeld"
    WEIGHTS_SOURCE_FAILED = "WeightsSourceFailed"
    WEIGHTS_SLOWER_LANE = "WeightsSlowerLane"
    STEP_TRAINED = "StepTrained"
    CHECKPOINTED = "Checkpointed"
    TRAINER_RESTORED = "TrainerRestored"
    TRAINER_STATE_HELD = "TrainerStateHeld"
    CONTROLLER_STARTED = "ControllerStarted"
    CONNECTION_REFUSED = "ConnectionRefused"
    SCHEDULER_ROLLED_BACK = "SchedulerRolledBack"
    HELD_OUT_STARTED = "HeldOutStarted"
    HELD_OUT_SCORED = "HeldOutScored"
    HEARTBEAT = "Heartbeat"
    ENGINE_RESIZED = "EngineResized"
    JOB_STALLED = "JobStalled"
    STOP_CHECKPOINT = "StopCheckpoint"


# Every event type the journal may hold, with the data keys it must carry.
EVENT_TYPES: dict[EventKind, tuple[str, ...]] = {
    EventKind.JOB_SUBMITTED: ("job_id", "spec_file", "backend", "policy"),
    EventKind.JOB_STATE_CHANGED: ("state", "reason"),
    EventKind.NODE_ALLOCATED: ("node", "host", "role", "slot"),
    EventKind.NODE_STATE_CHANGED: ("node", "state", "reason"),
    EventKind.AGENT_REGISTERED: ("node", "incarnation", "facts"),
    EventKind.AGENT_DISCONNECTED: ("node", "reason"),
    EventKind.HEARTBEAT_SUMMARY: ("beats", "nodes", "window_s"),
    EventKind.WORKER_STARTING: ("slot", "wid", "node", "role"),
    EventKind.WORKER_STARTED: ("slot", "wid", "pid"),
    EventKind.WORKER_PHASE: ("slot", "wid", "phase", "step"),
    EventKind.WORKER_EXITED: ("slot", "wid", "exit_code", "signal"),
    EventKind.FAULT_INJECTED: ("fault_id", "node", "kind", "params"),
    EventKind.FAULT_REFUSED: ("fault_id", "node", "reason"),
    # A delayed injection (``--after``), journaled when asked for; ``FaultInjected`` (same id) when due,
    # or ``FaultCancelled`` (by the operator, or when it can no longer be carried out).
    EventKind.FAULT_SCHEDULED: ("fault_id", "node", "kind", "params", "due_at"),
    EventKind.FAULT_ACCEPTED: ("fault_id", "node"),  # the agent (or backend) carried it out
    EventKind.FAULT_CANCELLED: ("fault_id", "node", "reason"),
    EventKind.CONNECTION_REFUSED: ("source", "node", "reason", "count"),
    EventKind.FAULT_SIGNAL: ("node", "kind", "detail"),
    EventKind.VERDICT: ("node", "slot", "verdict", "fault", "reason"),
    EventKind.ACTION_TAKEN: ("action", "node", "slot", "reason"),
    EventKind.FAULT_RECOVERED: ("fault_ids", "slot", "node"),
    EventKind.ROUND_STARTED: ("step", "kind", "weights_version", "max_new_tokens", "prompts", "target_groups"),
    EventKind.ITEMS_DISPATCHED: ("slot", "wid", "item_ids"),
    EventKind.ITEMS_RETURNED: ("item_ids", "reason"),
    EventKind.TRAJECTORY_STORED: ("item_id", "response_tokens", "truncated", "weights_version", "slot"),
    EventKind.PROMPT_DEFERRED: ("prompt_id", "step"),
    EventKind.REWARDS_STORED: ("scores",),
    EventKind.REWARD_FUNCTION_FAILED: ("function", "item_id", "prompt_id", "error", "on_error"),
    # Most of the recent reward calls failed (rlctl.core.reward_health), and when that was over.
    EventKind.REWARD_FUNCTION_FAILING: ("function", "failures", "calls", "consecutive", "last_error", "reason"),
    EventKind.REWARD_FUNCTION_RECOVERED: ("function", "failures", "calls", "reason"),
    EventKind.ENV_FAILED: ("item_id", "turn", "slot", "error", "action"),
    EventKind.SCORING_DISPATCHED: ("slot", "wid", "item_ids"),
    EventKind.BATCH_FORMED: ("step", "kind", "prompt_ids", "returned_prompt_ids"),
    EventKind.EPOCH_STARTED: ("epoch", "order"),
    EventKind.WEIGHTS_PUBLISHED: ("version", "slot", "source"),
    EventKind.WEIGHTS_HELD: ("version", "slot", "source"),
    EventKind.WEIGHTS_SOURCE_FAILED: ("version", "source", "reporter", "error"),
    # A warning, once per job: a pull went over tcp while a faster lane was there (rlctl.weights.lanes).
    EventKind.WEIGHTS_SLOWER_LANE: ("slot", "version", "lane", "faster_lane", "same_node", "gbps", "reason"),
    EventKind.STEP_TRAINED: ("step", "metrics"),
    EventKind.CHECKPOINTED: ("step", "path"),
    EventKind.TRAINER_RESTORED: ("slot", "checkpoint_step", "replayed_steps"),
    EventKind.TRAINER_STATE_HELD: ("slot", "wid", "step", "source"),
    EventKind.CONTROLLER_STARTED: ("pid", "resumed"),
    EventKind.SCHEDULER_ROLLED_BACK: ("to_step",),
    EventKind.HELD_OUT_STARTED: ("version", "prompts", "max_new_tokens"),
    EventKind.HELD_OUT_SCORED: ("version", "prompts", "reward_mean", "reward_std_err", "accuracy"),
    EventKind.HEARTBEAT: ("node",),
    EventKind.ENGINE_RESIZED: ("slot", "wid", "tensor_parallel", "gpus", "seconds"),
    EventKind.JOB_STALLED: ("since_version", "seconds"),
    # An operator's stop: whether the trainer checkpointed the version it held before it was stopped
    # (``outcome``: rlctl.core.stopsave.StopSaveOutcome), the wait and the newest checkpoint after it.
    EventKind.STOP_CHECKPOINT: ("outcome", "step", "checkpoint_step", "seconds", "timeout_s", "reason"),
}
# Applied to the model but never journaled: one per node per second is too many to keep. What they
# changed is journaled in summary (HeartbeatSummary); a resumed controller starts their clocks anew.
TRANSIENT_EVENTS = frozenset({EventKind.HEARTBEAT})


class EventError(ValueError):
    """An event of an unknown type, or missing a key its type requires."""


@dataclass(frozen=True)
class Event:
    """One fact. ``seq`` is assigned by the journal; ``at`` is controller wall time (seconds)."""

    type: EventKind
    at: float
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0

    def __post_init__(self) -> None:
        try:
            kind = EventKind(self.type)
        except ValueError:
            raise EventError(f"unknown event type {self.type!r}") from None
        object.__setattr__(self, "type", kind)  # a kind read back from the journal is a plain string
        required = EVENT_TYPES[kind]
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
        return cls(type=type_, at=at, data=body["data"], seq=seq)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": self.at, "data": self.data}


def event(type_: EventKind, at: float, **data: Any) -> Event:
    """Shorthand constructor: ``event(EventKind.VERDICT, now, node=..., ...)``."""
    return Event(type=type_, at=at, data=data)
