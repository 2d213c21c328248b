"""How a worker is started on its node: its command line and its environment.

The ``WorkerLauncher`` is handed the job spec, where its files live, whether the backend runs on
this machine, the workload seam (model folder, trainer collective settings) and the job model (to
find a trainer group's rendezvous). It decides nothing about when workers start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from rlctl_agent.protocol import GPUS_ENV

from rlctl.controller.seam import Workload
from rlctl.core.elastic import starts_parked
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.spec import JobSpec


class WorkerLauncher:
    def __init__(self, spec: JobSpec, model: JobModel, workload: Workload, checkpoints: Path,
                 node_dir: Path | None, on_this_machine: bool) -> None:
        self.spec = spec
        self.model = model
        self.workload = workload
        self.checkpoints = checkpoints
        self.node_dir = node_dir  # where each node's files live when the nodes are on this machine
        self.on_this_machine = on_this_machine

    def cwd(self, node: str) -> str:
        return str(self.node_dir / node) if self.node_dir is not None and self.on_this_machine else ""

    def forks_from_template(self, slot: SlotRecord) -> bool:
        """Whether the agent should fork this worker from its node's warm template (``[cluster]
        worker_template`` and the role's, or the spares', ``fork_from_template``)."""
        if not self.spec.worker_template:
            return False
        if slot.standby:
            return self.spec.standby_fork_from_template
        return self.spec.roles[slot.role].fork_from_template

    def argv_env(self, slot: SlotRecord) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        role = spec.roles[slot.role]
        python = sys.executable if self.on_this_machine else str(spec.cluster.get("python", "python3"))
        command = spec.standby_command if slot.standby else role.command
        argv = [python if part == "python" else part for part in command]
        workload = {
            **spec.workload,
            "seed": spec.seed,
            "steps": spec.steps,
            "checkpoint_every": spec.checkpoint_every,
            "replicate_trainer_state": spec.trainer_state_replicated(),
            "stream": bool(spec.trainer["stream"]),
            "stream_parts": int(spec.trainer["stream_parts"]),
            "group_size": spec.rollout.group_size,
            "batch_prompts": spec.rollout.batch_prompts,
            "max_new_tokens": spec.rollout.max_new_tokens,
            "algorithm": spec.algorithm.to_table(),
            "worker_batch": spec.rollout.worker_batch,
            "dataset_size": spec.rollout.dataset_size,
            "model": {**spec.model, "path": self.workload.model_path()},
            "reward": spec.reward,
            "env": spec.env.to_table(),
            "multi_turn": spec.multi_turn,
            "tensor_parallel_size": role.tensor_parallel_size if slot.role == "rollout" else 1,
            "colocated": spec.colocated and slot.role in ("trainer", "rollout"),
            "start_parked": slot.role == "rollout" and not slot.standby and self._group_runs_wide(slot),
            "weights_device_memory": spec.weights_device_memory,
            "weights_shared_memory": spec.weights_shared_memory,
        }
        ucx_defaults = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCXPY_PROGRESS_MODE": "blocking"}
        if self.on_this_machine:
            ucx_defaults["UCX_NET_DEVICES"] = "lo"
        if slot.role == "trainer":
            ucx_defaults.update(self._trainer_collective_env(slot))
            ucx_defaults.update(self._trainer_group_env(slot))
        env = {
            **{k: v for k, v in ucx_defaults.items() if k not in os.environ},
            **role.env,
            "RLCTL_WORKLOAD": json.dumps(workload),
            "RLCTL_CHECKPOINT_DIR": str(self.checkpoints),
            "RLCTL_WEIGHTS_TRANSPORT": spec.weights_transport,
            "RLCTL_WEIGHTS_HOST": self._weights_host(slot),
            "RLCTL_STANDBY": "1" if slot.standby else "0",
        }
        if slot.gpus and not slot.standby:
            # The agent maps these onto the node's CUDA_VISIBLE_DEVICES and attributes the GPUs' signals to the worker.
            env[GPUS_ENV] = ",".join(str(gpu) for gpu in slot.gpus)
        return argv, env

    def _group_runs_wide(self, slot: SlotRecord) -> bool:
        """Elastic rollout: the open round runs this engine's group wide, its leader on its GPUs."""
        scheduler = self.model.scheduler
        elastic = scheduler.config.elastic if scheduler is not None else None
        rnd = scheduler.round if scheduler is not None else None
        if elastic is None or rnd is None or rnd.closed or slot.node is None:
            return False
        return starts_parked(self.model.slots_on_node(slot.node), slot, rnd.tensor_parallel or elastic.base_tp, elastic)

    def _weights_host(self, slot: SlotRecord) -> str:
        """Where the worker's weight server listens and what it advertises.

        ``[weights] host`` is one address for the whole job. That is right when every worker runs
        on this machine but wrong across machines, where each holder must advertise its own node's
        address or joiners dial themselves. There a loopback setting (the default) therefore means
        "this node's address", as the backend reported it.
        """
        configured = self.spec.weights_host
        if self.on_this_machine or slot.node is None:
            return configured
        if not (configured.startswith("127.") or configured == "localhost"):
            return configured
        node = self.model.nodes.get(slot.node)
        return node.host if node is not None and node.host else configured

    def _trainer_group_env(self, slot: SlotRecord) -> dict[str, str]:
        """torch.distributed rendezvous for a trainer group (one rank per GPU, as torchrun sets it):
        rank = the slot's index, local rank its place among the trainer slots on its node, the store
        on trainer-0's node. Nothing for a single trainer."""
        group = self.model.slots_of("trainer")
        if len(group) < 2 or slot.standby:
            return {}
        on_node = sorted((s for s in group if s.node == slot.node), key=lambda s: int(s.slot.rsplit("-", 1)[1]))
        first = self.model.slots.get("trainer-0")
        master = first.node if first is not None else None
        host = self.spec.weights_host if self.on_this_machine or master is None else (
            self.model.nodes[master].host or master)
        return {"WORLD_SIZE": str(len(group)), "RANK": slot.slot.rsplit("-", 1)[1],
                "LOCAL_RANK": str(on_node.index(slot)), "LOCAL_WORLD_SIZE": str(len(on_node)),
                "MASTER_ADDR": host, "MASTER_PORT": str(trainer_rendezvous_port(self.model.job_id))}

    def _trainer_collective_env(self, slot: SlotRecord) -> dict[str, str]:
        """The workload's trainer settings (collective watchdogs) sized from the job's phase bounds."""
        bounds = self.spec.fault_tolerance.phase_timeout_s
        dump_dir = Path(self.cwd(slot.node or "") or ".")
        return self.workload.trainer_env(bounds["training"], bounds["checkpointing"], dump_dir)


def trainer_rendezvous_port(job_id: str) -> int:
    """The data-parallel trainers' store port: fixed per job (every restart of the group meets at the
    same place) and spread over 20000-29999 so that jobs sharing a machine do not collide."""
    return 20000 + int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) % 10000
