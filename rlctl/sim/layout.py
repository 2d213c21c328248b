"""Cluster layout for a simulated job: role node counts scaled to ``--gpus`` (the launch plan places
the roles on them, as it does for a live job)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rlctl.core.launchplan import ROLE_ORDER
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import ClusterCost, CostModel
from rlctl.sim.recipe import training_passes


@dataclass(frozen=True)
class Layout:
    """How many nodes each role gets, and the spares."""

    gpus_per_node: int
    nodes: dict[str, int]
    spares: int
    warm_spares: bool
    colocated: bool = False  # the rollout engines run on the trainer nodes (allocate none of their own)

    @property
    def role_nodes(self) -> int:
        return sum(n for role, n in self.nodes.items() if not (self.colocated and role == "rollout"))

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
        return Layout(cluster.gpus_per_node, nodes, spec.spare_nodes, spec.warm_spares, spec.colocated)
    total = max(3, gpus // cluster.gpus_per_node)
    trainer = max(1, round(total * cluster.trainer_share))
    reward = max(1, round(cluster.reward_nodes_per_256_gpus * gpus / 256))
    rollout = max(1, total - trainer - reward)
    spares = max(1, math.ceil(total * cluster.spare_fraction)) if spec.spare_nodes else 0
    if spec.colocated:
        trainer = rollout = max(1, total - reward)  # every role node runs a trainer rank group and engines
    nodes = {"trainer": trainer, "rollout": rollout, "reward": reward, "env": spec.roles["env"].nodes}
    return Layout(cluster.gpus_per_node, nodes, spares, spec.warm_spares, spec.colocated)


def colocated_costs(cost: CostModel, layout: Layout) -> CostModel:
    """A colocated layout's step costs. The trainer has every role node's GPUs, not its share of
    them (``cluster.trainer_share``): the same step's work spread over more GPUs, taken as linear,
    which is optimistic for a sharded trainer. Generation is bound by its longest response's
    per-token latency, which more engines do not shorten. Every step pays
    ``step.colocation_switch_s``: the engines sleep and wake, the optimizer state goes out and back."""
    if not layout.colocated:
        return cost
    split_trainer = max(1, round(layout.role_nodes * cost.cluster.trainer_share))
    train_s = cost.step.train_s * split_trainer / max(1, layout.nodes["trainer"])
    return replace(cost, step=replace(cost.step, train_s=train_s + cost.step.colocation_switch_s))


def layout_costs(cost: CostModel, layout: Layout, spec: JobSpec) -> CostModel:
    """The cost model for ``spec`` on ``layout``: ``step.train_s`` a whole step's training as its
    recipe trains (``rlctl.sim.recipe``), then its colocated step costs; a weight version served
    by every trainer GPU's rank and pulled by every rollout engine at once; with a trainer-state
    replica, each rank's step longer by serving its part; and, for a multi-turn job, a round's
    longest episode taking every turn ``[env] max_turns`` allows."""
    engines = max(1, layout.nodes["rollout"] * layout.gpus_per_node // max(1, spec.roles["rollout"].tensor_parallel_size))
    weights = replace(cost.weights, senders=max(1, layout.nodes["trainer"] * layout.gpus_per_node), pullers=engines)
    generation = replace(cost.generation, env_turns=spec.env.max_turns if spec.multi_turn else 0)
    training_s = training_passes(spec.algorithm, spec.rollout.batch_prompts).seconds(cost.step)
    priced = colocated_costs(replace(cost, step=replace(cost.step, train_s=training_s)), layout)
    if spec.trainer_state_replicated(weights.senders):  # each rank serves its part to the standby after every step
        priced = replace(priced, step=replace(priced.step, train_s=priced.step.train_s + weights.state_serve_s))
    return replace(priced, weights=weights, generation=generation)


def node_name(index: int) -> str:
    return f"n{index:05d}"


def colocated_spec(spec: JobSpec) -> JobSpec:
    """``spec`` with its engines colocated on the trainer nodes (``[roles.rollout] placement =
    "colocated"``): the simulator's colocated row of the same job."""
    trainer, rollout = spec.roles["trainer"], spec.roles["rollout"]
    engines = replace(rollout, colocated=True, nodes=trainer.nodes, gpus_per_node=trainer.gpus_per_node)
    return replace(spec, roles={**spec.roles, "rollout": engines})


def elastic_spec(spec: JobSpec, policy: str = "cost-model") -> JobSpec:
    """``spec`` with elastic rollout parallelism on (``[rollout.elastic]``, twice the engines'
    degree in a regrouped round): the simulator's elastic row of the same job. The simulated
    engines' curve comes from the cost model (``generation.wide_per_token_ratio``, ``regroup_s``)."""
    base = spec.roles["rollout"].tensor_parallel_size
    elastic = replace(spec.rollout.elastic, enabled=True, tensor_parallel_size=2 * base, policy=policy)
    return replace(spec, rollout=replace(spec.rollout, elastic=elastic))
