"""``rlctl lab``: bring a real local Slurm + sshd cluster up, report on it, take it down, break it.

``up`` is idempotent (re-running with the same shape is a no-op; a different shape tears the old
lab down first). ``down`` leaves no process, namespace, mount, bridge, /etc/hosts line or state
file behind and raises if it cannot prove that. Fault helpers act on one node at a time.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlctl.lab import config as c
from rlctl.lab import network, packages, procs, sshd
from rlctl.lab import slurm as lab_slurm
from rlctl.lab.shell import LabError, is_root, missing_tools, pid_alive, run

JOB_USER = "root"  # who jobs log in as over SSH (see LabStatus.job_toml)
NODE_NET_DEVICE = "eth0"  # a node's only link (its veth end into the bridge)
REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter", "mountpoint", "ssh-keygen", "runuser")
RUN_SSHD_MARKER = "created-run-sshd"


@dataclass(frozen=True)
class LabNode:
    """One lab node as seen now."""

    name: str
    ip: str
    slurm_state: str
    sshd_up: bool
    slurmd_up: bool
    link_up: bool


@dataclass(frozen=True)
class LabStatus:
    """The lab as seen now, plus the facts a job.toml needs to use it."""

    up: bool
    state_dir: Path
    nodes: list[LabNode] = field(default_factory=list)
    gpus_per_node: int = 0
    slurmctld_up: bool = False
    partition: str = c.PARTITION
    controller_address: str = c.CONTROLLER_IP
    known_hosts: Path | None = None
    ssh_key: Path | None = None
    ssh_config: Path | None = None
    slurm_conf: Path | None = None
    ssh_user: str = sshd.LAB_USER
    job_user: str = JOB_USER
    job_python: str = field(default_factory=lambda: sys.executable)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in data.items()}

    def job_toml(self) -> str:
        """``[cluster.ssh]`` and ``[cluster.slurm]`` sections that point a job at this lab.

        Jobs run as ``job_user`` (root) with ``job_python`` (the interpreter running this code):
        the nodes share this machine's filesystem, and both the interpreter (under /root) and the
        controller's job dir (checkpoints) belong to root; Slurm runs tasks as the submitting user
        anyway. Workers need UCX pointed at the node's bridge device (see docs/lab.md).
        """
        hosts = ", ".join(f'"{n.name}={n.ip}"' for n in self.nodes)
        return (
            "[cluster.ssh]\n"
            f"hosts = [{hosts}]\n"
            f'known_hosts = "{self.known_hosts}"\nkey_file = "{self.ssh_key}"\nuser = "{self.job_user}"\n'
            f'python = "{self.job_python}"\n'
            f'controller_host = "{self.controller_address}"\n'
            f'lab_dir = "{self.state_dir}"\n\n'
            "[cluster.slurm]\n"
            f'partition = "{self.partition}"\nslurm_conf = "{self.slurm_conf}"\n'
            f'python = "{self.job_python}"\n'
            f'controller_host = "{self.controller_address}"\n'
            f'lab_dir = "{self.state_dir}"\n\n'
            "# in every [roles.<role>.env]: UCX over the node's bridge device\n"
            f'# UCX_NET_DEVICES = "{NODE_NET_DEVICE}"\n# UCX_TLS = "tcp,self"\n# UCX_TCP_MAX_CONN_RETRIES = "2"\n'
        )


# --- up ----------------------------------------------------------------------------------------
def check_prerequisites() -> None:
    """Raise LabError unless we are root and the base tools exist."""
    if not is_root():
        raise LabError("rlctl lab needs root (it creates network namespaces, a bridge and daemons)")
    missing = missing_tools(REQUIRED_TOOLS)
    if missing:
        raise LabError(f"missing tools: {' '.join(missing)} (apt-get install iproute2 util-linux openssh-client)")


def up(
    nodes: int,
    gpus_per_node: int = 0,
    *,
    state_dir: Path = c.DEFAULT_STATE_DIR,
    install: bool = True,
    cpus_per_node: int = 8,
    slurmd_timeout_s: int = 10,
    idle_timeout_s: float = 120.0,
) -> LabStatus:
    """Build (or keep) a lab of ``nodes`` nodes. Idempotent; returns :func:`status`."""
    check_prerequisites()
    packages.ensure_packages(install=install)
    cfg = c.LabConfig(state_dir=Path(state_dir), nodes=nodes, gpus_per_node=gpus_per_node,
                      cpus_per_node=cpus_per_node, slurmd_timeout_s=slurmd_timeout_s)
    old = c.LabConfig.load(cfg.state_dir)
    if old is not None and old != cfg:
        down(state_dir=cfg.state_dir)
    _make_dirs(cfg)
    cfg.path("lab.json").write_text(cfg.to_json())
    lab_slurm.ensure_munge(cfg)
    sshd.ensure_lab_user(cfg)
    sshd_config_changed = sshd.ensure_keys(cfg)
    _ensure_network(cfg)
    lab_slurm.ensure_fake_gpu_devices(cfg)
    lab_slurm.write_configs(cfg)
    lab_slurm.ensure_slurmctld(cfg)
    for node in cfg.node_names():
        sshd.start_sshd(cfg, node, reload=sshd_config_changed)
        lab_slurm.start_slurmd(cfg, node)
    lab_slurm.wait_all_idle(cfg, idle_timeout_s)
    return status(state_dir=cfg.state_dir)


def _make_dirs(cfg: c.LabConfig) -> None:
    for sub in ("etc", "ssh", "ns", "run", "log", "slurmctld", "slurmd", "nodes", "munge", "dev"):
        cfg.path(sub).mkdir(parents=True, exist_ok=True)
    cfg.state_dir.chmod(0o755)
    run_sshd = Path("/run/sshd")
    if not run_sshd.exists():
        run_sshd.mkdir(mode=0o755, parents=True)
        cfg.path(RUN_SSHD_MARKER).touch()
    Path("/run/netns").mkdir(parents=True, exist_ok=True)


def _ensure_network(cfg: c.LabConfig) -> None:
    network.ensure_bridge()
    for node in cfg.node_names():
        network.ensure_node_netns(node)
        network.tune_node_tcp(node)
        network.ensure_uts(cfg.uts_file(node), node)
    network.ensure_uts(cfg.uts_file(c.CONTROLLER_HOSTNAME), c.CONTROLLER_HOSTNAME)
    if cfg.hosts_file:
        network.write_hosts_block(cfg)


# --- status ------------------------------------------------------------------------------------
def status(*, state_dir: Path = c.DEFAULT_STATE_DIR) -> LabStatus:
    """What is running now. ``up`` is False when no lab was built in ``state_dir``."""
    cfg = c.LabConfig.load(Path(state_dir))
    if cfg is None:
        return LabStatus(up=False, state_dir=Path(state_dir))
    states = lab_slurm.node_states(cfg)
    nodes = [
        LabNode(
            name=n,
            ip=c.node_ip(n),
            slurm_state=states.get(n, "unknown"),
            sshd_up=sshd.sshd_up(cfg, n),
            slurmd_up=pid_alive(lab_slurm.slurmd_pidfile(cfg, n)) is not None,
            link_up=_link_up(n),
        )
        for n in cfg.node_names()
    ]
    ctld = pid_alive(cfg.path("run", "slurmctld.pid")) is not None
    return LabStatus(
        up=ctld and all(n.sshd_up and n.slurmd_up for n in nodes),
        state_dir=cfg.state_dir, nodes=nodes, gpus_per_node=cfg.gpus_per_node, slurmctld_up=ctld,
        known_hosts=cfg.known_hosts, ssh_key=cfg.ssh_key, ssh_config=cfg.ssh_config, slurm_conf=cfg.slurm_conf,
    )


def _link_up(node: str) -> bool:
    out = run(["ip", "-o", "link", "show", c.veth(node)], check=False).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags


# --- down --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DownReport:
    """What ``down`` removed and proof that nothing is left."""

    killed: int
    leftover_pids: list[int]
    leftover_netns: list[str]
    bridge_left: bool
    hosts_block_left: bool
    state_dir_left: bool

    @property
    def clean(self) -> bool:
        return not (self.leftover_pids or self.leftover_netns or self.bridge_left
                    or self.hosts_block_left or self.state_dir_left)


def down(*, state_dir: Path = c.DEFAULT_STATE_DIR, keep_state: bool = False) -> DownReport:
    """Tear the lab down completely. Idempotent. Raises LabError if anything is left behind."""
    check_prerequisites()
    cfg = c.LabConfig.load(Path(state_dir)) or c.LabConfig(state_dir=Path(state_dir))
    pids = procs.lab_pids(cfg)
    procs.kill_pids(pids)
    procs.kill_pids(procs.lab_pids(cfg), grace_s=1.0)  # anything forked during the TERM phase
    network.delete_network()
    network.unmount_uts(cfg)
    network.remove_hosts_block()
    lab_slurm.remove_etc_links(cfg)
    sshd.remove_lab_user(cfg)
    if cfg.path(RUN_SSHD_MARKER).exists():
        shutil.rmtree("/run/sshd", ignore_errors=True)
    if not keep_state:
        shutil.rmtree(cfg.state_dir, ignore_errors=True)
    report = DownReport(
        killed=len(pids),
        leftover_pids=sorted(procs.lab_pids(cfg)),
        leftover_netns=network.lab_netns_list(),
        bridge_left=network.link_exists(c.BRIDGE),
        hosts_block_left=c.HOSTS_BEGIN in network.HOSTS_FILE.read_text(),
        state_dir_left=cfg.state_dir.exists() and not keep_state,
    )
    if not report.clean:
        raise LabError(f"lab down left things behind: {report}")
    return report


# --- faults ------------------------------------------------------------------------------------
def _cfg(state_dir: Path) -> c.LabConfig:
    cfg = c.LabConfig.load(Path(state_dir))
    if cfg is None:
        raise LabError(f"no lab in {state_dir} (run `rlctl lab up` first)")
    return cfg


def _check_node(cfg: c.LabConfig, node: str) -> None:
    if node not in cfg.node_names():
        raise LabError(f"{node} is not a node of the lab in {cfg.state_dir} (nodes: {', '.join(cfg.node_names())})")


def partition(node: str, *, state_dir: Path = c.DEFAULT_STATE_DIR) -> None:
    """Cut ``node`` off the network (its link goes down); its processes keep running."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    network.set_link(node, up=False)


def heal(node: str, *, state_dir: Path = c.DEFAULT_STATE_DIR) -> None:
    """Undo :func:`partition` and :func:`slow_link` for ``node``. A node that was cut off has its
    slurmd register again (with every other: ``scontrol reconfigure``): slurmctld then settles at
    once what it could not tell the node meanwhile. Left alone, a kill it sent into the partition
    (an allocation cancelled there) is resent only on slurmctld's own cycle, 1 to 48 s after the
    heal in the lab, with the allocation COMPLETING meanwhile."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    was_cut = not _link_up(node)
    network.clear_delay(node)
    network.set_link(node, up=True)
    if was_cut and pid_alive(lab_slurm.slurmd_pidfile(cfg, node)):
        lab_slurm.register_nodes_again(cfg)


def slow_link(node: str, delay_ms: int, *, state_dir: Path = c.DEFAULT_STATE_DIR) -> str:
    """Slow ``node``'s link by ``delay_ms`` (tc netem in its namespace; tbf where the kernel has no
    netem). Returns the method used. :func:`heal` clears it."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    return network.set_delay(node, delay_ms)


def node_down(node: str, *, state_dir: Path = c.DEFAULT_STATE_DIR) -> int:
    """Machine death: SIGKILL every process in ``node`` (slurmd, sshd, agents). Returns how many."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    return len(procs.kill_node_now(node))


def node_up(node: str, *, state_dir: Path = c.DEFAULT_STATE_DIR, resume: bool = True) -> None:
    """Repair: restart the node's sshd and slurmd; optionally ``scontrol update state=resume``."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    sshd.start_sshd(cfg, node)
    lab_slurm.start_slurmd(cfg, node)
    if resume:
        lab_slurm.resume_node(cfg, node)


FAULT_KINDS = ("partition", "heal", "node-down", "node-up", "slow")


def apply_fault(node: str, kind: str, params: dict[str, Any], *, state_dir: Path = c.DEFAULT_STATE_DIR) -> None:
    """Dispatch a fault by name (what the backends' ``inject`` calls). Blocking."""
    if kind == "partition":
        partition(node, state_dir=state_dir)
    elif kind == "heal":
        heal(node, state_dir=state_dir)
    elif kind == "node-down":
        node_down(node, state_dir=state_dir)
    elif kind == "node-up":
        node_up(node, state_dir=state_dir)
    elif kind == "slow":
        slow_link(node, int(params.get("delay_ms", 100)), state_dir=state_dir)
    else:
        raise LabError(f"unknown lab fault {kind!r} for {node} (known: {', '.join(FAULT_KINDS)})")


def node_exec_argv(node: str, argv: list[str], *, state_dir: Path = c.DEFAULT_STATE_DIR) -> list[str]:
    """``argv`` wrapped to run inside ``node`` (for tests and debugging)."""
    cfg = _cfg(state_dir)
    _check_node(cfg, node)
    return network.in_node_argv(cfg, node, argv)


