"""The journal's schema: one frozen dataclass per event kind, every field named and typed.

Role: what each kind of event says. A field without a default is a key every event of its kind
holds; one with a default is optional, absent from the data when at its default, and its comment
says when it is there. ``PAYLOADS`` maps each kind to its dataclass and ``SCHEMAS`` to the checks
its data gets (``base.Schema``); ``rlctl.core.events`` builds an event's typed view from them. The
types are what the journal holds after a JSON round trip: lists (never tuples), str keys, int or
float. Pure, stdlib only.
"""

from __future__ import annotations

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload, Schema, schema_of
from rlctl.core.event_payloads.faults import (
    ActionTakenData,
    FaultAcceptedData,
    FaultCancelledData,
    FaultInjectedData,
    FaultRecoveredData,
    FaultRefusedData,
    FaultScheduledData,
    FaultSignalData,
    VerdictData,
)
from rlctl.core.event_payloads.job import (
    ConnectionRefusedData,
    ControllerStartedData,
    JobStalledData,
    JobStateChangedData,
    JobSubmittedData,
    StopCheckpointData,
)
from rlctl.core.event_payloads.nodes import (
    AgentDisconnectedData,
    AgentRegisteredData,
    HeartbeatData,
    HeartbeatSummaryData,
    NodeAllocatedData,
    NodeStateChangedData,
)
from rlctl.core.event_payloads.rounds import (
    BatchFormedData,
    EpochStartedData,
    ItemsDispatchedData,
    ItemsReturnedData,
    PromptDeferredData,
    RoundExtendedData,
    RoundStartedData,
    SchedulerRolledBackData,
    ScoringDispatchedData,
    TrajectoryStoredData,
)
from rlctl.core.event_payloads.scoring import (
    EnvFailedData,
    HeldOutScoredData,
    HeldOutStartedData,
    RewardFunctionFailedData,
    RewardFunctionFailingData,
    RewardFunctionRecoveredData,
    RewardsStoredData,
)
from rlctl.core.event_payloads.weights import (
    CheckpointedData,
    CheckpointFailedData,
    CheckpointRejectedData,
    StepTrainedData,
    TrainerRestoredData,
    TrainerStateHeldData,
    WeightsHeldData,
    WeightsPublishedData,
    WeightsSlowerLaneData,
    WeightsSourceFailedData,
)
from rlctl.core.event_payloads.workers import (
    EngineResizedData,
    WorkerExitedData,
    WorkerPhaseData,
    WorkerStartedData,
    WorkerStartingData,
)

__all__ = [
    "PAYLOADS", "SCHEMAS", "ActionTakenData", "AgentDisconnectedData", "AgentRegisteredData", "BatchFormedData",
    "CheckpointFailedData", "CheckpointRejectedData", "CheckpointedData", "ConnectionRefusedData", "ControllerStartedData", "EngineResizedData", "EnvFailedData",
    "EpochStartedData", "EventPayload", "FaultAcceptedData", "FaultCancelledData", "FaultInjectedData",
    "FaultRecoveredData", "FaultRefusedData", "FaultScheduledData", "FaultSignalData", "HeartbeatData",
    "HeartbeatSummaryData", "HeldOutScoredData", "HeldOutStartedData", "ItemsDispatchedData", "ItemsReturnedData",
    "JobStalledData", "JobStateChangedData", "JobSubmittedData", "NodeAllocatedData", "NodeStateChangedData",
    "PromptDeferredData", "RewardFunctionFailedData", "RewardFunctionFailingData", "RewardFunctionRecoveredData",
    "RewardsStoredData", "RoundExtendedData", "RoundStartedData", "SchedulerRolledBackData", "Schema", "ScoringDispatchedData",
    "StepTrainedData", "StopCheckpointData", "TrainerRestoredData", "TrainerStateHeldData", "TrajectoryStoredData",
    "VerdictData", "WeightsHeldData", "WeightsPublishedData", "WeightsSlowerLaneData", "WeightsSourceFailedData",
    "WorkerExitedData", "WorkerPhaseData", "WorkerStartedData", "WorkerStartingData",
]

PAYLOADS: dict[EventKind, type[EventPayload]] = {payload.KIND: payload for payload in (
    JobSubmittedData, JobStateChangedData, ControllerStartedData, ConnectionRefusedData, JobStalledData,
    StopCheckpointData,
    NodeAllocatedData, NodeStateChangedData, AgentRegisteredData, AgentDisconnectedData, HeartbeatData,
    HeartbeatSummaryData,
    WorkerStartingData, WorkerStartedData, WorkerPhaseData, WorkerExitedData, EngineResizedData,
    FaultInjectedData, FaultRefusedData, FaultScheduledData, FaultAcceptedData, FaultCancelledData, FaultSignalData,
    VerdictData, ActionTakenData, FaultRecoveredData,
    EpochStartedData, RoundStartedData, RoundExtendedData, ItemsDispatchedData, ItemsReturnedData, TrajectoryStoredData,
    PromptDeferredData, ScoringDispatchedData, BatchFormedData, SchedulerRolledBackData,
    RewardsStoredData, RewardFunctionFailedData, RewardFunctionFailingData, RewardFunctionRecoveredData,
    EnvFailedData, HeldOutStartedData, HeldOutScoredData,
    WeightsPublishedData, WeightsHeldData, WeightsSourceFailedData, WeightsSlowerLaneData, StepTrainedData,
    CheckpointedData, CheckpointRejectedData, CheckpointFailedData, TrainerRestoredData, TrainerStateHeldData,
)}
SCHEMAS: dict[EventKind, Schema] = {kind: schema_of(payload) for kind, payload in PAYLOADS.items()}
