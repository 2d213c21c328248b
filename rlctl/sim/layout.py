"""Cluster layout for a simulated job: role node counts scaled to ``--gpus``, and the placement.

The placement events are the live controller's (server.Controller._placement_events): trainers,
then rollouts, then rewards, then spares (warm standbys when ``[spares].warm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlctl.core.events import Event, EventKind, event
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import ClusterCost

ROLE_ORDER = ("trainer", "rollout", "reward")


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
    return Layout(cluster.gpus_per_node, {"trainer": trainer, "rollout": rollout, "reward": reward}, spares,
                  spec.warm_spares)


def node_name(index: int) -> str:
    return f"n{index:05d}"


def placement_events(layout: Layout, at: float) -> list[Event]:
    """NodeAllocated for every node, in the live controller's order and slot naming."""
    events: list[Event] = []
    index = 0
    for role in ROLE_ORDER:
        for slot_index in range(layout.nodes[role]):
            name = node_name(index)
            events.append(event(EventKind.NODE_ALLOCATED, at, node=name, host=name, role=role, slot=f"{role}-{slot_index}",
                                backend_ref=name))
            index += 1
    for spare_index in range(layout.spares):
        name = node_name(index)
        slot = f"standby-{spare_index}" if layout.warm_spares else ""
        events.append(event(EventKind.NODE_ALLOCATED, at, node=name, host=name, role="spare", slot=slot, role_of_slot="trainer",
                            standby=True, backend_ref=name))
        index += 1
    return events
