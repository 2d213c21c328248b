"""Payloads of the weights' and the trainer's events: publishes, pulls, steps, checkpoints, restores.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class WeightsPublishedData(EventPayload):
    """The trainer on ``slot`` published weights ``version``; ``source``: how to fetch them from it."""

    KIND: ClassVar[EventKind] = EventKind.WEIGHTS_PUBLISHED
    version: int
    slot: str
    source: dict[str, Any]
    state_source: dict[str, Any] | None = None  # the trainer serves its full state too (for a warm standby)


@dataclass(frozen=True)
class WeightsHeldData(EventPayload):
    """The worker on ``slot`` holds weights ``version`` and serves them from ``source``; after a pull,
    what the pull took (``rlctl.roles.rollout.pull_record``): a trainer's own publish has none of it."""

    KIND: ClassVar[EventKind] = EventKind.WEIGHTS_HELD
    version: int
    slot: str
    source: dict[str, Any]
    bytes: int | None = None  # a pull: the bytes it fetched
    seconds: float | None = None  # a pull: how long it took
    holders: int | None = None  # a pull: the holders it fetched stripes from
    lane: str | None = None  # a pull: the lane class it took (tcp, sm, cuda_ipc...; "other")
    faster_lane: str | None = None  # a pull over a slower lane than the node has: the faster one
    path: str | None = None  # a pull: the transport path it took
    lanes: list[str] | None = None  # a pull: the lanes the transport reported
    gbps: float | None = None  # a pull: its rate
    same_node: bool | None = None  # a pull: the holder was on the puller's node
    memory: str | None = None  # a pull: where it landed, "host" or "device" (GPU memory: [weights] device_memory)


@dataclass(frozen=True)
class WeightsSourceFailedData(EventPayload):
    """Worker ``reporter`` could not fetch weights ``version`` from ``source``."""

    KIND: ClassVar[EventKind] = EventKind.WEIGHTS_SOURCE_FAILED
    version: int
    source: dict[str, Any]
    reporter: str
    error: str


@dataclass(frozen=True)
class WeightsSlowerLaneData(EventPayload):
    """A warning, once per job: a pull went over ``lane`` while ``faster_lane`` was there
    (``rlctl.weights.lanes``)."""

    KIND: ClassVar[EventKind] = EventKind.WEIGHTS_SLOWER_LANE
    slot: str
    version: int
    lane: str
    faster_lane: str
    same_node: bool
    gbps: float
    reason: str


@dataclass(frozen=True)
class StepTrainedData(EventPayload):
    """The trainer trained ``step``: its metrics (``mean_reward``, the batch's statistics...)."""

    KIND: ClassVar[EventKind] = EventKind.STEP_TRAINED
    step: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class CheckpointedData(EventPayload):
    """The trainer checkpointed ``step`` at ``path``."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINTED
    step: int
    path: str


@dataclass(frozen=True)
class CheckpointRejectedData(EventPayload):
    """The checkpoint of ``step`` at ``path`` does not match its checksums (``file``: the first file
    that does not, ``reason``: how): no restore uses it again."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT_REJECTED
    step: int
    path: str
    file: str
    reason: str


@dataclass(frozen=True)
class CheckpointFailedData(EventPayload):
    """The trainer could not write the checkpoint of ``step`` at ``path`` on its ``attempt``-th try
    (from 0; ``error``: why). The previous checkpoint stays whole, the batches since stay kept."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT_FAILED
    step: int
    path: str
    error: str
    attempt: int = 0


@dataclass(frozen=True)
class TrainerRestoredData(EventPayload):
    """The trainer on ``slot`` (re)started from ``checkpoint_step`` (None: the initial weights) and
    retrained ``replayed_steps``."""

    KIND: ClassVar[EventKind] = EventKind.TRAINER_RESTORED
    slot: str
    checkpoint_step: int | None
    replayed_steps: list[int]
    state_step: int | None = None  # restored from a warm standby's copy of the trainer state at this step


@dataclass(frozen=True)
class TrainerStateHeldData(EventPayload):
    """The warm standby ``wid`` holds and serves the trainer's full state after ``step`` steps."""

    KIND: ClassVar[EventKind] = EventKind.TRAINER_STATE_HELD
    slot: str
    wid: str | None
    step: int
    source: dict[str, Any]
