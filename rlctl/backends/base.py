"""The backend protocol: how a controller gets nodes, starts agents on them and gives them back.

One implementation per kind of cluster (local processes, SSH inventory, Slurm). Backends are
asynchronous, translate foreign states (Slurm strings, SSH errors) at their boundary, and keep
whatever they need to survive a controller restart in the job directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlctl.core.launchplan import AllocationRequest

__all__ = ["AgentLaunch", "AllocationRequest", "Backend", "BackendError", "FaultInjector", "NodeInfo", "ProbeResult"]


@dataclass(frozen=True)
class NodeInfo:
    """A node the backend handed to the job. ``name`` is the node's name in the job (node01...)."""

    name: str
    host: str
    backend_ref: str = ""
    gpus: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentLaunch:
    """Everything an agent needs to reach its controller. The secret goes into a 0600 file only."""

    job_id: str
    controller_host: str
    controller_port: int
    secret_hex: str
    gpu_provider: str
    sim_gpus: int
    agent_zipapp: Path
    agent_zipapp_sha256: str
    tls_cert_pem: str = ""  # the job's certificate the agent pins; empty: a plain TCP link
    orphan_timeout_s: float = 1800.0  # the agent gives up on an unreachable controller after this long

    def agent_config(self, node: str, workdir: str) -> dict[str, Any]:
        """The agent's JSON config for ``node`` (holds the secret: write it 0600 only)."""
        config: dict[str, Any] = {
            "job_id": self.job_id,
            "node": node,
            "controller_host": self.controller_host,
            "controller_port": self.controller_port,
            "secret_hex": self.secret_hex,
            "workdir": workdir,
            "gpu_provider": self.gpu_provider,
            "sim_gpus": self.sim_gpus,
            "orphan_timeout_s": self.orphan_timeout_s,
        }
        if self.tls_cert_pem:
            config["tls_cert_pem"] = self.tls_cert_pem
        return config


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the second-path probe: can the node be reached other than through its agent?"""

    reachable: bool
    detail: str


class BackendError(RuntimeError):
    """A backend operation failed in a way the caller should report (names the node and step)."""


class FaultInjector(Protocol):
    """Backend-level faults (a partition, a node down, a slow link) carried out on a backend's
    nodes for ``rlctl inject-fault``. Given to a backend from outside (``rlctl.assembly`` builds the
    lab's from ``[cluster.*] lab_dir``), so the backends know nothing of the lab."""

    supported_faults: frozenset[str]

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> bool:
        """Apply ``kind`` to the node named ``node``; False for a kind it does not know."""
        ...

    async def close(self) -> None:
        """Cancel pending undo timers."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Contract every backend satisfies. All methods are idempotent unless stated."""

    name: str
    #: Whether the nodes are processes on the controller's own machine (the embedded local
    #: backend): they share its interpreter, filesystem and loopback, and their GPUs are simulated.
    #: False for real hosts, whose agents reach the controller across a network.
    on_this_machine: bool

    @property
    def supported_faults(self) -> frozenset[str]:
        """The backend-level faults ``inject`` can carry out here (none without a fault injector)."""
        ...

    def plan_text(self, request: AllocationRequest) -> str:
        """Human-readable plan for ``launch --dry-run`` (rendered sbatch scripts for Slurm). No side effects."""
        ...

    async def allocate(self, request: AllocationRequest) -> list[NodeInfo]:
        """Acquire nodes for all roles and spares. Not idempotent: call once per job (resume uses ``adopt``)."""
        ...

    async def adopt(self, nodes: list[NodeInfo]) -> None:
        """Take back nodes a previous controller of this job allocated (after a controller restart)."""
        ...

    async def start_agent(self, node: NodeInfo, launch: AgentLaunch) -> None:
        """Ship the agent (only if its hash changed) and its 0600 config, and start it. Idempotent."""
        ...

    async def probe(self, node: NodeInfo) -> ProbeResult:
        """Second-path liveness check. Never raises for an unreachable node; says so in the result."""
        ...

    async def replace(self, bad: NodeInfo, exclude: frozenset[str]) -> NodeInfo | None:
        """A fresh node for a failed one, never one in ``exclude``; None when none can be had."""
        ...

    async def inject(self, node: NodeInfo, kind: str, params: dict[str, Any]) -> bool:
        """Carry out a backend-level fault (partition, node-down, slow link). False if unsupported."""
        ...

    async def release(self, nodes: list[NodeInfo]) -> None:
        """Stop agents and give nodes back. Idempotent."""
        ...

    async def close(self) -> None:
        """Release connections the backend holds (SSH sessions); leaves nodes as they are."""
        ...
