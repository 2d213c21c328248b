"""The rlctl lab: a real local Slurm + sshd cluster, one network namespace per node.

Public API (all need root)::

    up(nodes, gpus_per_node=0, state_dir=...) -> LabStatus
    down(state_dir=...) -> DownReport
    status(state_dir=...) -> LabStatus
    partition(node) / heal(node) / node_down(node) / node_up(node) / slow_link(node, delay_ms)

See docs/lab.md for the layout and the gotchas found while building it.
"""

from rlctl.lab.cluster import (
    FAULT_KINDS,
    DownReport,
    LabNode,
    LabStatus,
    apply_fault,
    check_prerequisites,
    down,
    heal,
    node_down,
    node_exec_argv,
    node_up,
    partition,
    slow_link,
    status,
    up,
)
from rlctl.lab.config import CONTROLLER_IP, DEFAULT_STATE_DIR, PARTITION, LabConfig
from rlctl.lab.shell import LabError

__all__ = [
    "CONTROLLER_IP",
    "DEFAULT_STATE_DIR",
    "FAULT_KINDS",
    "PARTITION",
    "DownReport",
    "LabConfig",
    "LabError",
    "LabNode",
    "LabStatus",
    "apply_fault",
    "check_prerequisites",
    "down",
    "heal",
    "node_down",
    "node_exec_argv",
    "node_up",
    "partition",
    "slow_link",
    "status",
    "up",
]
