"""Lab layout: names, addresses and paths, all derived from one :class:`LabConfig`.

A node ``nodeNN`` is a network namespace ``rlctl-nodeNN`` (eth0 = 10.213.0.(10+NN)/24, joined by
a veth pair ``rlcv-nodeNN`` to the bridge ``rlctlbr0`` = 10.213.0.1/24 in the root namespace)
plus a persistent UTS namespace bind-mounted at ``<state>/ns/nodeNN.uts`` (hostname nodeNN).
Nodes have no default route and ip_forward is never touched: no packet leaves the machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_STATE_DIR = Path("/var/lib/rlctl-lab")
NET_PREFIX = "10.213.0"
CONTROLLER_IP = f"{NET_PREFIX}.1"
CONTROLLER_HOSTNAME = "rlctl"
BRIDGE = "rlctlbr0"
NETNS_PREFIX = "rlctl-"
VETH_PREFIX = "rlcv-"
PARTITION = "main"
HOSTS_BEGIN = "# rlctl-lab-begin"
HOSTS_END = "# rlctl-lab-end"
MAX_NODES = 200
# TCP inside the nodes gives up on a silent peer in seconds instead of the kernel's ~15 min
# (tcp_retries2=15) and ~2 min (tcp_syn_retries=6): a partition then breaks in-flight transfers
# (UCX over TCP, the agent link) as fast as SlurmdTimeout=10 makes Slurm notice it. Per netns.
NODE_TCP_SYSCTLS = {"net.ipv4.tcp_retries2": "3", "net.ipv4.tcp_syn_retries": "1"}


@dataclass(frozen=True)
class LabConfig:
    """What ``lab up`` builds. Persisted as ``<state_dir>/lab.json`` so ``status``/``down`` find it.

    ``slurmd_timeout_s``: seconds without a slurmd answer before slurmctld marks a node DOWN and
    fails its jobs with NODE_FAIL. Production clusters use 300 s; the lab uses 10 s so that fault
    tests see a node failure in ~10-20 s (slurmctld pings every SlurmdTimeout/3 s).
    """

    state_dir: Path = DEFAULT_STATE_DIR
    nodes: int = 4
    gpus_per_node: int = 0
    cpus_per_node: int = 8
    slurmd_timeout_s: int = 10
    message_timeout_s: int = 10
    hosts_file: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, got {self.nodes}")
        if not 0 <= self.gpus_per_node <= 64:
            raise ValueError(f"gpus_per_node must be 0..64, got {self.gpus_per_node}")

    # --- names -------------------------------------------------------------------------------
    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(1, self.nodes + 1)]

    # --- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return Path(self.state_dir, *parts)

    @property
    def slurm_conf(self) -> Path:
        return self.path("etc", "slurm.conf")

    @property
    def known_hosts(self) -> Path:
        return self.path("ssh", "known_hosts")

    @property
    def ssh_key(self) -> Path:
        return self.path("ssh", "id_ed25519")

    @property
    def ssh_config(self) -> Path:
        return self.path("ssh", "ssh_config")

    @property
    def munge_socket(self) -> Path:
        return self.path("munge", "munge.socket")

    def uts_file(self, host: str) -> Path:
        return self.path("ns", f"{host}.uts")

    # --- persistence -------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def load(cls, state_dir: Path = DEFAULT_STATE_DIR) -> LabConfig | None:
        """The config of the lab in ``state_dir``, or None if no lab was built there."""
        try:
            data = json.loads((Path(state_dir) / "lab.json").read_text())
        except (OSError, ValueError):
            return None
        data["state_dir"] = Path(data["state_dir"])
        return cls(**data)


def node_name(index: int) -> str:
    """node01, node02, ... (1-based)."""
    return f"node{index:02d}"


def node_index(name: str) -> int:
    """Inverse of :func:`node_name`; raises ValueError for names that are not lab nodes."""
    if not name.startswith("node") or not name[4:].isdigit():
        raise ValueError(f"not a lab node name: {name!r}")
    return int(name[4:])


def node_ip(name: str) -> str:
    return f"{NET_PREFIX}.{10 + node_index(name)}"


def netns(name: str) -> str:
    return f"{NETNS_PREFIX}{name}"


def veth(name: str) -> str:
    return f"{VETH_PREFIX}{name}"
