"""Lifecycles as data: node, worker and job states with their legal transitions.

Every transition is recorded as (state, time, reason); an illegal transition raises.
The termination reason (``xid-79``, ``heartbeat-lost``, ``exit-code-1``, ``operator``...) is kept
apart from the state. Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar


class NodeState(str, Enum):
    ALLOCATING = "allocating"
    STARTING = "starting"
    READY = "ready"
    STANDBY = "standby"
    ACTIVE = "active"
    SUSPECT = "suspect"
    FAILED = "failed"
    DRAINING = "draining"
    RELEASED = "released"


N = NodeState
NODE_TRANSITIONS: dict[NodeState, dict[NodeState, str]] = {
    N.ALLOCATING: {
        N.STARTING: "the backend handed us the node; its agent is being started",
        N.FAILED: "allocation failed",
        N.RELEASED: "the job stopped before the node arrived",
    },
    N.STARTING: {
        N.READY: "its agent registered",
        N.FAILED: "the agent never registered or the node died while starting",
        N.DRAINING: "the job is stopping",
    },
    N.READY: {
        N.ACTIVE: "a role worker was placed on it",
        N.STANDBY: "kept as a spare",
        N.SUSPECT: "heartbeats missing",
        N.FAILED: "a hardware signal or confirmed loss",
        N.DRAINING: "the job is stopping",
    },
    N.STANDBY: {
        N.ACTIVE: "a spare took over a failed node's role",
        N.SUSPECT: "heartbeats missing",
        N.FAILED: "a hardware signal or confirmed loss",
        N.DRAINING: "the job is stopping",
    },
    N.ACTIVE: {
        N.SUSPECT: "heartbeats missing or a worker judged unhealthy",
        N.FAILED: "a hardware signal or confirmed loss",
        N.READY: "its role worker was moved away (e.g. trainer role handed to another node)",
        N.DRAINING: "the job is stopping",
    },
    N.SUSPECT: {
        N.ACTIVE: "heartbeats resumed: suspicion refuted",
        N.STANDBY: "heartbeats resumed on a spare",
        N.READY: "heartbeats resumed on an idle node",
        N.FAILED: "loss confirmed by the second path",
        N.DRAINING: "the job is stopping",
    },
    N.FAILED: {
        N.DRAINING: "being taken out of the job",
        N.RELEASED: "given back to the backend",
    },
    N.DRAINING: {N.RELEASED: "its agent stopped and the backend released it"},
    N.RELEASED: {},
}


class WorkerState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUSPECT = "suspect"
    FAILED = "failed"
    STOPPING = "stopping"
    EXITED = "exited"


W = WorkerState
WORKER_TRANSITIONS: dict[WorkerState, dict[WorkerState, str]] = {
    W.STARTING: {
        W.RUNNING: "the agent reported the process started",
        W.FAILED: "it could not start or died at once",
        W.STOPPING: "stopped before it ran",
        W.EXITED: "it exited before the start was reported",
    },
    W.RUNNING: {
        W.SUSPECT: "progress frozen or slow beyond its phase bound",
        W.FAILED: "crashed, hung or its node failed",
        W.STOPPING: "asked to stop",
        W.EXITED: "it finished and exited 0",
    },
    W.SUSPECT: {
        W.RUNNING: "progress resumed",
        W.FAILED: "the verdict was confirmed",
        W.STOPPING: "asked to stop",
        W.EXITED: "it finished",
    },
    W.FAILED: {W.STOPPING: "being cleaned up", W.EXITED: "the process is gone"},
    W.STOPPING: {W.EXITED: "the process is gone", W.FAILED: "it died while stopping"},
    W.EXITED: {},
}


class JobState(str, Enum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.STOPPED, JobState.FAILED)


ENDED_JOB_STATES: tuple[str, ...] = tuple(state.value for state in JobState if state.terminal)
"""The states a job ends in, as ``status`` and the journal spell them."""

J = JobState
JOB_TRANSITIONS: dict[JobState, dict[JobState, str]] = {
    J.PENDING: {J.STARTING: "the controller is allocating nodes", J.FAILED: "it could not start", J.STOPPING: "stopped"},
    J.STARTING: {
        J.RUNNING: "every role has a running worker",
        J.STOPPING: "stopped while starting",
        J.FAILED: "allocation or agent start failed",
        J.RECOVERING: "a fault hit while starting",
    },
    J.RUNNING: {
        J.RECOVERING: "a fault was detected and recovery began",
        J.STOPPING: "asked to stop or all steps done",
        J.FAILED: "recovery is impossible",
    },
    J.RECOVERING: {
        J.RUNNING: "the failed role is back",
        J.STOPPING: "asked to stop",
        J.FAILED: "recovery is impossible",
    },
    J.STOPPING: {
        J.SUCCEEDED: "all steps done and everything released",
        J.STOPPED: "stopped by the operator and everything released",
        J.FAILED: "stopped after an unrecoverable fault",
    },
    J.SUCCEEDED: {},
    J.STOPPED: {},
    J.FAILED: {},
}

S = TypeVar("S", NodeState, WorkerState, JobState)

_TABLES: dict[type, dict] = {NodeState: NODE_TRANSITIONS, WorkerState: WORKER_TRANSITIONS, JobState: JOB_TRANSITIONS}


class IllegalTransition(ValueError):
    """A transition that is not an edge of the lifecycle's table."""


@dataclass(frozen=True)
class Transition(Generic[S]):
    state: S
    at: float
    reason: str


@dataclass
class Lifecycle(Generic[S]):
    """A state with its recorded history; ``move`` enforces the transition table."""

    state: S
    since: float
    history: list[Transition[S]] = field(default_factory=list)

    @classmethod
    def begin(cls, state: S, at: float, reason: str) -> Lifecycle[S]:
        return cls(state=state, since=at, history=[Transition(state, at, reason)])

    def can_move(self, new: S) -> bool:
        return new in _TABLES[type(self.state)][self.state]

    def move(self, new: S, at: float, reason: str) -> None:
        """Go to ``new``; raise IllegalTransition if the table has no such edge. Same state is a no-op."""
        if new == self.state:
            return
        if not self.can_move(new):
            raise IllegalTransition(f"{type(self.state).__name__} {self.state.value} -> {new.value} ({reason})")
        self.state = new
        self.since = at
        self.history.append(Transition(new, at, reason))
