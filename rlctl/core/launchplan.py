"""The launch plan: a job spec's roles onto nodes, and the allocation the backend is asked for.

``plan(spec)`` is pure. ``rlctl launch --dry-run`` prints it (with the backend's rendering of the
allocation, the sbatch scripts on Slurm) and the controller carries out the same plan: it asks the
backend for ``plan.allocation(job_id)`` and places the roles on the nodes it got in the plan's order
(``Orchestrator.place``). The simulator builds its plan from the same function.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlctl.core.spec import JobSpec

ROLE_ORDER = ("trainer", "rollout", "reward", "env")


@dataclass(frozen=True)
class AllocationRequest:
    """Nodes wanted per role, plus spares. ``exclude`` names nodes never to be used."""

    job_id: str
    nodes_by_role: dict[str, int]
    spares: int
    gpus_per_node: dict[str, int]
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RolePlan:
    """A role's nodes and their workers: ``workers_per_node`` processes of ``gpus_per_worker`` GPUs
    each. Slot ``<role>-<i>`` is worker ``i % workers_per_node`` of the role's node ``i //
    workers_per_node`` and holds that worker's GPUs; the trainer's slot index is its rank."""

    role: str
    nodes: int
    gpus_per_node: int
    command: tuple[str, ...]
    workers_per_node: int = 1
    gpus_per_worker: int = 0
    colocated: bool = False  # its workers share the trainer's nodes (and their GPUs): it allocates no nodes

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(f"{self.role}-{index}" for index in range(self.nodes * self.workers_per_node))

    def node_slots(self, node_index: int) -> dict[str, list[int]]:
        """The slots of the role's ``node_index``-th node, each with the GPUs (local indices) it holds."""
        per_node, per_worker = self.workers_per_node, self.gpus_per_worker
        return {f"{self.role}-{node_index * per_node + local}": list(range(local * per_worker, (local + 1) * per_worker))
                for local in range(per_node)}


@dataclass(frozen=True)
class LaunchPlan:
    job: str
    backend: str
    steps: int
    policy: str
    roles: tuple[RolePlan, ...]
    spares: int
    warm_spares: bool
    gpus_per_node: int  # what each node's agent reports (simulated GPUs on the local backend)
    controller_host: str

    @property
    def nodes_by_role(self) -> dict[str, int]:
        """The nodes each role allocates (a colocated role none: it runs on the trainer's)."""
        return {role.role: role.nodes for role in self.roles if not role.colocated}

    @property
    def nodes(self) -> int:
        return sum(self.nodes_by_role.values()) + self.spares

    def allocation(self, job_id: str) -> AllocationRequest:
        return AllocationRequest(job_id=job_id, nodes_by_role=self.nodes_by_role, spares=self.spares,
                                 gpus_per_node={role.role: role.gpus_per_node for role in self.roles if not role.colocated})

    def scaled(self, nodes_by_role: dict[str, int], spares: int) -> LaunchPlan:
        """The same plan with other node counts (a role not named keeps its own), each node one
        worker: the simulator's ``--gpus`` (its cost model prices a node's work as a whole)."""
        return replace(self, roles=tuple(replace(role, nodes=nodes_by_role.get(role.role, role.nodes), workers_per_node=1)
                                         for role in self.roles), spares=spares)

    def lines(self) -> list[str]:
        return [
            f"job {self.job}: {self.steps} steps, policy {self.policy}, backend {self.backend}",
            "roles: " + ", ".join(f"{r.role} x{r.nodes}{' colocated on the trainer nodes' if r.colocated else ''} "
                                  f"({r.gpus_per_node} GPU/node, {r.workers_per_node} "
                                  f"worker(s)/node): {' '.join(r.command)}" for r in self.roles),
            f"spares: {self.spares} ({'warm trainer standby' if self.warm_spares else 'cold'})",
        ]


def plan(spec: JobSpec) -> LaunchPlan:
    return LaunchPlan(
        job=spec.name,
        backend=spec.backend,
        steps=spec.steps,
        policy=spec.fault_tolerance.policy,
        roles=tuple(RolePlan(name, role.nodes, role.gpus_per_node, role.command, role.workers_per_node,
                             role.gpus_per_worker, role.colocated)
                    for name in ROLE_ORDER for role in (spec.roles[name],)),
        spares=spec.spare_nodes,
        warm_spares=spec.warm_spares,
        gpus_per_node=int(spec.cluster.get("gpus_per_node", 1)),
        controller_host=str(spec.cluster.get("controller_host", "127.0.0.1")),
    )
