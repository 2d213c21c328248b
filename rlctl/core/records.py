"""The records the job model keeps: a node, a worker slot, a fault, a trainer-state offer, a GPU
summary. Plain data; the model's ``apply`` is what changes them. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.core.states import Lifecycle, NodeState, WorkerState


@dataclass(frozen=True)
class GpuSummary:
    """One node's latest GPU sample, condensed: means of utilisation and temperature, memory sums.

    Kept instead of the raw per-GPU dicts: at thousands of nodes at 1 Hz, short-lived dicts that
    survive into the old GC generation cost the controller long collection pauses.
    """

    util: float | None
    temp_c: float | None
    mem_used: float
    mem_total: float

    @classmethod
    def of(cls, gpus: list[dict[str, Any]]) -> GpuSummary | None:
        if not gpus:
            return None
        utils = [float(g["util"]) for g in gpus if g.get("util") is not None]
        temps = [float(g["temp_c"]) for g in gpus if g.get("temp_c") is not None]
        return cls(
            util=round(sum(utils) / len(utils), 1) if utils else None,
            temp_c=round(sum(temps) / len(temps), 1) if temps else None,
            mem_used=sum(float(g.get("mem_used") or 0) for g in gpus),
            mem_total=sum(float(g.get("mem_total") or 0) for g in gpus),
        )


@dataclass
class NodeRecord:
    name: str
    host: str
    role: str  # trainer | rollout | reward | spare
    life: Lifecycle[NodeState]
    incarnation: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    connected: bool = False
    last_heartbeat_at: float | None = None
    gpu_summary: GpuSummary | None = None
    last_signal: str = ""
    excluded: bool = False
    backend_ref: str = ""
    gpus_lost: bool = False  # set with every GPU sample: NVML (or the simulation) says a GPU is gone


@dataclass
class SlotRecord:
    """A role position (``rollout-1``) and the worker that currently fills it."""

    slot: str
    role: str
    node: str | None
    wid: str | None = None
    generation: int = 0
    life: Lifecycle[WorkerState] | None = None
    phase: str = "starting"
    phase_step: int = 0
    phase_since: float = 0.0
    progress: float = 0.0
    progress_at: float = 0.0
    pid: int | None = None
    restarts_on_node: int = 0
    weights_version: int = -1
    standby: bool = False
    gpus: tuple[int, ...] = ()  # the node's GPUs (local indices) its worker holds; () on a node without GPUs
    tensor_parallel: int | None = None  # an engine's degree after its last resize (0: parked); None: the role's
    serving: bool = False  # its worker has reached its role since it started (loaded, restored, holds the weights)
    failed_starts: int = 0  # workers in a row that failed before they served (on any node)
    last_error: str = ""  # how the last of those failed: the exit and the error it logged
    failure_counted: str = ""  # the worker whose failure ``failed_starts`` last counted (each counts once)

    def count_failed_start(self, wid: str, how: str) -> None:
        """Worker ``wid`` of this slot failed before it served: one more failed start, counted once."""
        if self.serving or not wid or self.failure_counted == wid:
            return
        self.failure_counted = wid
        self.failed_starts += 1
        self.last_error = f"worker {wid} on {self.node}: {how}"[:400]


@dataclass
class FaultRecord:
    fault_id: str
    kind: str
    node: str
    slot: str | None
    occurred_at: float
    injected: bool
    detected_at: float | None = None
    recovered_at: float | None = None
    verdict: str = ""
    action: str = ""
    reason: str = ""
    impact: float = 1.0
    trajectories_lost: int = 0
    refused: str = ""  # why the agent or backend refused to carry the injection out
    # An injection handed to its agent (or backend) and not yet answered: open (a verdict may see it),
    # but it takes nothing from the job until it is carried out, so a refused one costs nothing.
    awaiting_answer: bool = False
    heals_at: float | None = None  # an injected fault that ends by itself after its duration

    @property
    def open(self) -> bool:
        return self.recovered_at is None and not self.refused


@dataclass(frozen=True)
class TrainerStateOffer:
    """The trainer's full state after ``version`` steps, served by worker ``wid`` for a warm standby to copy."""

    version: int
    slot: str
    wid: str | None
    source: dict[str, Any]
