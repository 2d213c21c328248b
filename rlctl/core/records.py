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
