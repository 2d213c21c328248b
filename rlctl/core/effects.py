"""What the orchestration core asks of the world: effects, and the shell that carries them out.

An effect is a plain value (start this worker, give that node back, wait); a plan is a generator of
effects into which the shell sends each one's result. The live controller's shell carries effects
out with real backends (``rlctl.controller.effects``), the simulator's under virtual time
(``rlctl.sim.effects``). Pure data.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from rlctl.core.events import Event

# ------------------------------------------------------------------------------------ effects


@dataclass(frozen=True)
class NodeGrant:
    """A node a backend handed over: its name, address and the backend's own reference."""

    name: str
    host: str
    backend_ref: str


@dataclass(frozen=True)
class StartWorker:
    """Start worker ``wid`` (already journaled as WorkerStarting) in ``slot`` on ``node``."""

    slot: str
    wid: str
    node: str
    role: str
    standby: bool


@dataclass(frozen=True)
class StopWorker:
    """Stop worker ``wid`` (journaled as stopping). ``wait``: the plan goes on only once it is gone."""

    slot: str
    wid: str
    node: str
    role: str
    standby: bool
    grace_s: float
    wait: bool = True


@dataclass(frozen=True)
class StopEverything:
    """Stop every live worker of the job at once (the full-restart baseline)."""

    stops: tuple[StopWorker, ...]


@dataclass(frozen=True)
class ReleaseNode:
    """Give a failed node back to the backend; its workers are gone with it."""

    node: str


@dataclass(frozen=True)
class ReplaceNode:
    """Ask the backend for a node in place of ``bad_node``, never one of ``exclude``.
    Its result is a ``NodeGrant``, or None when the backend has none."""

    bad_node: str
    exclude: frozenset[str]


@dataclass(frozen=True)
class StartAgent:
    """Start (or, ``restart``, start again) the node agent on ``node``."""

    node: str
    restart: bool = False


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Requeue:
    """The full-restart baseline gives the whole job back to the scheduler and waits to run again."""


@dataclass(frozen=True)
class StandbyTakesOver:
    """The warm standby now in ``slot`` takes its role (the live standby notices by polling)."""

    slot: str


@dataclass(frozen=True)
class WorkReturned:
    """A failed worker's in-flight work went back to the scheduler: hand it out again."""


@dataclass(frozen=True)
class TrainingAbandoned:
    """The step in progress is dropped (a rollback, or a stop of everything)."""


Effect = (StartWorker | StopWorker | StopEverything | ReleaseNode | ReplaceNode | StartAgent | Sleep | Requeue
          | StandbyTakesOver | WorkReturned | TrainingAbandoned)
Plan = Generator[Effect, Any, None]


class Shell(Protocol):
    """What the orchestrator needs from whoever runs it (the controller, the simulator)."""

    def clock(self) -> float:
        """Now, in the shell's seconds (wall time live, virtual time in the simulator)."""
        ...

    def commit(self, events: list[Event]) -> list[Event]:
        """Journal ``events`` (where there is a journal) and apply them to the model (the round
        scheduler skips the ones it decided itself and so holds already)."""
        ...

    def connected(self, node: str) -> bool:
        """Whether ``node``'s agent is connected now."""
        ...

    def run_plan(self, plan: Plan) -> None:
        """Carry out ``plan``'s effects in order, in the background, sending each one's result back."""
        ...


def some(effect: Effect | None) -> list[Effect]:
    return [] if effect is None else [effect]


def in_order(effects: Iterable[Effect]) -> Plan:
    yield from effects
