"""What the simulator's parts share: a run's settings, its tallies, the fluid task, and the view of
the running simulation each part is typed against.

Each part receives only what it uses: fault injection (``InjectSite``), armed faults, which fire
through injection (``ArmedSite``), the effect runner (``EffectsSite``), the pipeline, which reaches
armed faults (``PipelineSite``), and the report (``ReportSite``). ``engine.Simulation`` provides
them all; none of them imports the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlctl.core.detector import Detector
from rlctl.core.event_payloads import EventPayload
from rlctl.core.events import Event
from rlctl.core.injections import Injection
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.rounds import RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.tick import Observations, TickDecisions
from rlctl.sim.clock import EventQueue
from rlctl.sim.costmodel import CostModel
from rlctl.sim.faults import FailureModel, SimFault
from rlctl.sim.layout import Layout
from rlctl.sim.truth import NodeTruth, WorkerTruth


@dataclass(frozen=True)
class SimConfig:
    policy: str = "role"
    steps: int | None = None  # None: the job file's steps
    duration_s: float = 7 * 86400.0
    stall_s: float = 86400.0  # a running job that trains no step for this long has stalled: it ends, failed
    seed: int = 0
    gpus: int | None = None
    record_events: bool = False


@dataclass
class ArmedFaults:
    """Faults waiting for a worker's phase (``rlctl.sim.armed``), and the roles whose model files are broken."""

    waiting: list[tuple[Injection, SimFault]] = field(default_factory=list)
    broken_roles: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class StepGeneration:
    """What a step's round generated and kept, when its batch formed."""

    generated: int  # samples generated for the step: trained, filtered, deferred and returned
    trained: int  # samples in the batch
    groups: int  # groups in the batch
    filtered: int  # groups dynamic sampling dropped
    gen_batches: int  # draws of the round's first size it took (``Round.gen_batches``)


@dataclass
class SimStats:
    faults_injected: int = 0
    faults_skipped: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    events: int = 0
    rounds: dict[str, int] = field(default_factory=dict)
    steps_trained: int = 0
    stalled_s: float = 0.0  # how long the job had trained no step when the simulator ended it
    refills: int = 0  # generation passes over prompts dynamic sampling drew into an open round
    refill_s: float = 0.0  # their generation seconds at full capacity
    generation: dict[int, StepGeneration] = field(default_factory=dict)  # by step, the last round that formed it


@dataclass
class FluidTask:
    """``work`` seconds at full capacity, progressing at ``rate`` (0..1) since ``since``."""

    stage: str
    work: float
    rate: float
    since: float
    done: float = 0.0

    def advance(self, now: float) -> None:
        self.done = min(self.work, self.done + (now - self.since) * self.rate)
        self.since = now

    def eta(self) -> float | None:
        left = self.work - self.done
        if left <= 1e-9:
            return self.since
        return None if self.rate <= 0 else self.since + left / self.rate


class EffectsSite(Protocol):
    """What ``rlctl.sim.effects`` uses: carrying the core's effects out on the simulated cluster."""
    cost: CostModel
    model: JobModel
    orc: Orchestrator
    nodes: dict[str, NodeTruth]
    workers: dict[str, WorkerTruth]

    def agent_connected(self, name: str) -> bool: ...

    def start_agent(self, name: str, delay: float) -> None: ...

    def new_node(self) -> str: ...

    def launch_worker(self, slot_name: str, wid: str) -> None: ...

    def kill(self, worker: WorkerTruth) -> None: ...

    def take_over(self, worker: WorkerTruth, slot: SlotRecord) -> None: ...

    def update_capacity(self) -> None: ...

    def on_trainer_lost(self) -> None: ...

    def on_items_returned(self) -> None: ...

    def cancel_task(self) -> None: ...

    def after(self, delay: float, callback: Callable[..., None], *args: Any) -> None: ...


class InjectSite(Protocol):
    """What ``rlctl.sim.inject`` uses: a fault's ground truth and what the controller observes of it."""
    cost: CostModel
    rng: random.Random
    q: EventQueue
    model: JobModel
    detector: Detector
    orc: Orchestrator
    nodes: dict[str, NodeTruth]
    workers: dict[str, WorkerTruth]
    stats: SimStats
    armed: ArmedFaults
    interval: float

    @property
    def now(self) -> float: ...

    @property
    def task(self) -> FluidTask | None: ...

    @property
    def stopping(self) -> bool: ...

    def emit(self, payload: EventPayload) -> Event: ...

    def reconcile(self, seen: Observations) -> TickDecisions: ...

    def agent_connected(self, name: str) -> bool: ...

    def start_agent(self, name: str, delay: float) -> None: ...

    def kill(self, worker: WorkerTruth) -> None: ...

    def update_capacity(self) -> None: ...

    def working_slots(self, role: str) -> list[SlotRecord]: ...


class ArmedSite(InjectSite, Protocol):
    """What ``rlctl.sim.armed`` uses (and, through it, ``rlctl.sim.inject``): the faults armed for a
    phase, and firing them."""

    def inject(self, fault: SimFault) -> None: ...


class PipelineSite(ArmedSite, Protocol):
    """What ``rlctl.sim.pipeline`` uses (and, through it, ``rlctl.sim.armed`` and ``rlctl.sim.inject``):
    the RL pipeline's phases."""
    spec: JobSpec
    config: SimConfig
    failures: FailureModel
    scheduler: RoundScheduler

    def commit(self, events: list[Event]) -> list[Event]: ...

    def role_slots(self, role: str) -> list[SlotRecord]: ...

    def current(self, wid: str) -> tuple[WorkerTruth, SlotRecord] | None:
        """The worker ``wid`` if it is alive and still its slot's worker."""
        ...

    def node_ok(self, name: str) -> bool: ...

    def trainer_rate(self) -> float: ...

    def role_rate(self, role: str) -> float: ...

    def beating_nodes(self) -> int: ...


class ReportSite(Protocol):
    """What ``rlctl.sim.report`` uses: a finished run's figures."""
    spec: JobSpec
    cost: CostModel
    config: SimConfig
    failures: FailureModel
    layout: Layout
    q: EventQueue
    model: JobModel
    orc: Orchestrator
    stats: SimStats
    end_to_end_s: float | None
