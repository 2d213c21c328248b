"""The kinds of event the journal may hold, by the name the journal stores.

Role: the one list of kinds, below both the events (``rlctl.core.events``) and their payloads
(``rlctl.core.event_payloads``), so each can name a kind without importing the other. Pure.
"""

from __future__ import annotations

from enum import StrEnum


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
    ROUND_EXTENDED = "RoundExtended"
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
    CHECKPOINT_REJECTED = "CheckpointRejected"
    CHECKPOINT_FAILED = "CheckpointFailed"
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
