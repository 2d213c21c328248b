"""Payloads of the workers' events: starting, started, their phases, their exits, engine resizes.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class WorkerStartingData(EventPayload):
    """Worker ``wid`` of ``slot`` is to start on ``node``."""

    KIND: ClassVar[EventKind] = EventKind.WORKER_STARTING
    slot: str
    wid: str
    node: str
    role: str
    generation: int | None = None  # the slot's start count with this one; absent: one more than before
    standby: bool = False  # a warm standby (of a spare node)


@dataclass(frozen=True)
class WorkerStartedData(EventPayload):
    """The worker's process runs as ``pid``."""

    KIND: ClassVar[EventKind] = EventKind.WORKER_STARTED
    slot: str
    wid: str
    pid: int


@dataclass(frozen=True)
class WorkerPhaseData(EventPayload):
    """The worker reported ``phase`` (loading, training, stopping...) at ``step``."""

    KIND: ClassVar[EventKind] = EventKind.WORKER_PHASE
    slot: str
    wid: str
    phase: str
    step: int


@dataclass(frozen=True)
class WorkerExitedData(EventPayload):
    """The worker is gone: its ``exit_code``, or the ``signal`` that ended it (or why it is gone:
    ``node-failed``, ``lost-while-disconnected``)."""

    KIND: ClassVar[EventKind] = EventKind.WORKER_EXITED
    slot: str
    wid: str
    exit_code: int | None
    signal: str | None
    error: str = ""  # the last error the worker logged, when its agent saw one
    reason: str = ""  # stopped without a controller (``rlctl stop`` offline): why


@dataclass(frozen=True)
class EngineResizedData(EventPayload):
    """A rollout engine parked (``tensor_parallel`` 0) or was rebuilt over ``gpus`` in ``seconds``."""

    KIND: ClassVar[EventKind] = EventKind.ENGINE_RESIZED
    slot: str
    wid: str
    tensor_parallel: int
    gpus: list[int]
    seconds: float
