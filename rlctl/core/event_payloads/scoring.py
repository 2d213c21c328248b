"""Payloads of scoring's events: rewards, the reward function's failures, environments, held-out runs.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class RewardsStoredData(EventPayload):
    """Scores stored, each ``{item_id, reward, correct}``, with ``metrics`` when the function gave
    some and ``failed`` when the function failed (the zero is then not its score)."""

    KIND: ClassVar[EventKind] = EventKind.REWARDS_STORED
    scores: list[dict[str, Any]]


@dataclass(frozen=True)
class RewardFunctionFailedData(EventPayload):
    """The reward function raised, timed out or died on one sample; ``on_error`` what the job does."""

    KIND: ClassVar[EventKind] = EventKind.REWARD_FUNCTION_FAILED
    function: str
    item_id: str
    prompt_id: str
    error: str
    on_error: str


@dataclass(frozen=True)
class RewardFunctionFailingData(EventPayload):
    """Most of the recent reward calls failed (``rlctl.core.reward_health``)."""

    KIND: ClassVar[EventKind] = EventKind.REWARD_FUNCTION_FAILING
    function: str
    failures: int
    calls: int
    consecutive: int
    last_error: str
    reason: str


@dataclass(frozen=True)
class RewardFunctionRecoveredData(EventPayload):
    """The recent reward calls are healthy again."""

    KIND: ClassVar[EventKind] = EventKind.REWARD_FUNCTION_RECOVERED
    function: str
    failures: int
    calls: int
    reason: str


@dataclass(frozen=True)
class EnvFailedData(EventPayload):
    """An environment call of a multi-turn episode failed at ``turn``; ``action``: retry | score."""

    KIND: ClassVar[EventKind] = EventKind.ENV_FAILED
    item_id: str
    turn: int
    slot: str
    error: str
    action: str


@dataclass(frozen=True)
class HeldOutStartedData(EventPayload):
    """Weights ``version`` are evaluated on the held-out ``prompts``."""

    KIND: ClassVar[EventKind] = EventKind.HELD_OUT_STARTED
    version: int
    prompts: list[str]
    max_new_tokens: int
    samples_per_prompt: int = 1  # ``[algorithm.val_kwargs] n``: each prompt's score is the mean of its samples


@dataclass(frozen=True)
class HeldOutScoredData(EventPayload):
    """The held-out evaluation of weights ``version`` over ``prompts`` prompts."""

    KIND: ClassVar[EventKind] = EventKind.HELD_OUT_SCORED
    version: int
    prompts: int
    reward_mean: float
    reward_std_err: float
    accuracy: float
