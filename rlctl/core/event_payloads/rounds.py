"""Payloads of the round scheduler's events: epochs, rounds, samples handed out and back, batches.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class EpochStartedData(EventPayload):
    """Epoch ``epoch`` began: the prompts in the ``order`` they are taken."""

    KIND: ClassVar[EventKind] = EventKind.EPOCH_STARTED
    epoch: int
    order: list[str]


@dataclass(frozen=True)
class RoundStartedData(EventPayload):
    """Round ``step`` (``kind``: short | long | sync) generates from ``prompts`` with weights
    ``weights_version``, until ``target_groups`` groups are scored."""

    KIND: ClassVar[EventKind] = EventKind.ROUND_STARTED
    step: int
    kind: str
    weights_version: int
    max_new_tokens: int
    prompts: list[str]
    target_groups: int
    tensor_parallel: int | None = None  # an elastic long round: the engines' width for it; absent: the base width
    estimate: dict[str, float] | None = None  # an elastic long round: the seconds each choice was estimated at


@dataclass(frozen=True)
class RoundExtendedData(EventPayload):
    """Dynamic sampling (DAPO's ``filter_groups``): round ``step`` draws ``prompts`` more, because the
    groups that did not vary left it unable to fill its batch."""

    KIND: ClassVar[EventKind] = EventKind.ROUND_EXTENDED
    step: int
    prompts: list[str]


@dataclass(frozen=True)
class ItemsDispatchedData(EventPayload):
    """Samples ``item_ids`` handed to rollout worker ``wid`` to generate."""

    KIND: ClassVar[EventKind] = EventKind.ITEMS_DISPATCHED
    slot: str
    wid: str
    item_ids: list[str]


@dataclass(frozen=True)
class ItemsReturnedData(EventPayload):
    """Samples ``item_ids`` given back (their worker failed, or their weights were stale)."""

    KIND: ClassVar[EventKind] = EventKind.ITEMS_RETURNED
    item_ids: list[str]
    reason: str


@dataclass(frozen=True)
class TrajectoryStoredData(EventPayload):
    """A generated sample, stored: its response, generated with weights ``weights_version`` on ``slot``."""

    KIND: ClassVar[EventKind] = EventKind.TRAJECTORY_STORED
    item_id: str
    response_tokens: list[int]
    truncated: bool
    weights_version: int
    slot: str
    env: dict[str, Any] | None = None  # a multi-turn episode: its observation spans, reward, turns, error


@dataclass(frozen=True)
class PromptDeferredData(EventPayload):
    """A short round's truncated prompt, moved to the long rounds."""

    KIND: ClassVar[EventKind] = EventKind.PROMPT_DEFERRED
    prompt_id: str
    step: int


@dataclass(frozen=True)
class ScoringDispatchedData(EventPayload):
    """Generated samples ``item_ids`` handed to worker ``wid`` to score."""

    KIND: ClassVar[EventKind] = EventKind.SCORING_DISPATCHED
    slot: str
    wid: str
    item_ids: list[str]


@dataclass(frozen=True)
class BatchFormedData(EventPayload):
    """Round ``step`` closed: its batch is the groups of ``prompt_ids``; ``returned_prompt_ids`` go
    back to the pool."""

    KIND: ClassVar[EventKind] = EventKind.BATCH_FORMED
    step: int
    kind: str
    prompt_ids: list[str]
    returned_prompt_ids: list[str]
    filtered_prompt_ids: list[str] = dataclasses.field(default_factory=list)  # dynamic sampling dropped these groups


@dataclass(frozen=True)
class SchedulerRolledBackData(EventPayload):
    """Full-restart baseline: the batches from ``to_step`` on are forgotten."""

    KIND: ClassVar[EventKind] = EventKind.SCHEDULER_ROLLED_BACK
    to_step: int
