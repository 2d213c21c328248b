"""Cluster layout for a simulated job: role node counts scaled to ``--gpus`` (the launch plan places
the roles on them, as it does for a live job)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlctl.core.launchplan import ROLE_ORDER
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import ClusterCost


@dataclass(frozen=True)
class Layout:
    """How many nodes each role gets, and the spares."""

    gpus_per_node: int
    nodes: dict[str, int]
    spares: int
    warm_spares: bool

    @property
    def role_nodes(self) -> int:
        return sum(self.nodes.values())

    @property
    def role_gpus(self) -> int:
        return self.role_nodes * self.gpus_per_node

    @property
    def total_gpus(self) -> int:
        return (self.role_nodes + self.spares) * self.gpus_per_node


def layout_for(spec: JobSpec, cluster: ClusterCost, gpus: int | None) -> Layout:
    """The job file's node counts, or ``gpus`` split by the cost model's shares (spares on top)."""
    if gpus is None:
        nodes = {role: spec.roles[role].nodes for role in ROLE_ORDER}
        return Layout(cluster.gpus_per_node, nodes, spec.spare_nodes, spec.warm_spares)
    total = max(3, gpus // cluster.gpus_per_node)
    trainer = max(1, round(total * cluster.trainer_share))
    reward = max(1, round(cluster.reward_nodes_per_256_gpus * gpus / 256))
    rollout = max(1, total - trainer - reward)
    spares = max(1, math.ceil(total * cluster.spare_fraction)) if spec.spare_nodes else 0
    nodes = {"trainer": trainer, "rollout": rollout, "reward": reward, "env": spec.roles["env"].nodes}
    return Layout(cluster.gpus_per_node, nodes, spares, spec.warm_spares)


def node_name(index: int) -> str:
    return f"n{index:05d}"
