"""Payloads of the nodes' events: allocated, their state, their agents and heartbeats.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class NodeAllocatedData(EventPayload):
    """A node joined the job for ``role`` (``spare``: a spare node), ``slot`` its first worker slot
    (``""``: a cold spare, with none)."""

    KIND: ClassVar[EventKind] = EventKind.NODE_ALLOCATED
    node: str
    host: str
    role: str
    slot: str
    # Every worker slot of the node with the GPUs (local indices) it holds; absent: one worker, ``slot``.
    slots: dict[str, list[int]] | None = None
    # The role of each slot where they differ (colocated engines on a trainer node); absent: ``role``.
    slot_roles: dict[str, str] | None = None
    role_of_slot: str | None = None  # a spare's slot: the role its warm standby stands by for
    standby: bool = False  # the slots are warm standbys (a spare node's)
    backend_ref: str = ""  # how the backend names the node (a folder, a Slurm node); "" when it has none


@dataclass(frozen=True)
class NodeStateChangedData(EventPayload):
    """A node moved to ``state`` (a ``NodeState`` value)."""

    KIND: ClassVar[EventKind] = EventKind.NODE_STATE_CHANGED
    node: str
    state: str
    reason: str
    exclude: bool = False  # a failed node never to be granted to the job again
    role: str | None = None  # the node takes this role now (a spare taking over a slot, or kept as a spare)


@dataclass(frozen=True)
class AgentRegisteredData(EventPayload):
    """A node's agent said hello: its ``incarnation`` and the ``facts`` it reported (GPUs, workers)."""

    KIND: ClassVar[EventKind] = EventKind.AGENT_REGISTERED
    node: str
    incarnation: int
    facts: dict[str, Any]


@dataclass(frozen=True)
class AgentDisconnectedData(EventPayload):
    """A node's agent connection closed."""

    KIND: ClassVar[EventKind] = EventKind.AGENT_DISCONNECTED
    node: str
    reason: str


@dataclass(frozen=True)
class HeartbeatData(EventPayload):
    """One agent heartbeat (applied to the model, never journaled)."""

    KIND: ClassVar[EventKind] = EventKind.HEARTBEAT
    node: str
    gpus: list[dict[str, Any]] = field(default_factory=list)  # the GPU samples, one per GPU
    workers: list[dict[str, Any]] = field(default_factory=list)  # each worker's ``wid``, progress and its age


@dataclass(frozen=True)
class HeartbeatSummaryData(EventPayload):
    """The ``beats`` heard from ``nodes`` nodes in the last ``window_s`` seconds."""

    KIND: ClassVar[EventKind] = EventKind.HEARTBEAT_SUMMARY
    beats: int
    nodes: int
    window_s: float
    # Every node not named in ``silent`` was heard after this time; absent (the simulator, old journals):
    # no node's clock moves.
    fresh_since: float | None = None
    silent: dict[str, float | None] = field(default_factory=dict)  # the quiet nodes: each one's last heartbeat
    last_seen: dict[str, float] = field(default_factory=dict)  # before ``fresh_since``: each node's last heartbeat
