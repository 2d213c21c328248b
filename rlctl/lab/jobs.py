"""The reference RL job pointed at the lab: one job.toml text for the Slurm or the SSH backend.

Shared by ``tests/lab/test_jobs_on_lab.py`` and ``bench/slurm_recovery.py`` so that the tests and
the figure run the same job. The controller runs on this host (``controller_address``), agents
and role workers on lab nodes with this host's interpreter (the nodes share the filesystem) as
root (see :meth:`LabStatus.job_toml`), weights move over UCX on the nodes' bridge device, and
heartbeats are 1 s so a lost node is confirmed in about 2 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlctl.lab.cluster import JOB_USER, NODE_NET_DEVICE, LabStatus
from rlctl.lab.reference_jobs import SMALL_WORKLOAD_TABLES

# UCX on the node's only link; TCP transport (no RDMA in the lab); give up on an unreachable
# holder after 2 connection retries instead of 25, so a joiner asks for another holder quickly.
UCX_ENV = {"UCX_NET_DEVICES": NODE_NET_DEVICE, "UCX_TLS": "tcp,self", "UCX_TCP_MAX_CONN_RETRIES": "2"}

_JOB = """\
[job]
name = "{name}"
steps = {steps}
seed = 1
checkpoint_every = 3

[cluster]
backend = "{backend}"
{cluster}
[roles.trainer]
nodes = 1
{role_env}
[roles.rollout]
nodes = {rollouts}
{role_env}
[roles.reward]
nodes = 1
{role_env}
[spares]
nodes = {spares}
warm = {warm}

[weights]
transport = "ucx"

[fault_tolerance]
policy = "role"
heartbeat_interval_s = 1.0
min_silence_s = 2.0
max_restarts_per_slot = 3

[fault_tolerance.phase_timeout_s]
generating = 20.0
training = 20.0
weight-sync = 20.0
scoring = 20.0
loading = 90.0

""" + SMALL_WORKLOAD_TABLES


def _cluster_table(backend: str, lab: LabStatus, work_dir: Path, ssh_spares: list[str], state_dir: Path) -> str:
    python = sys.executable
    if backend == "slurm":
        return (
            f'[cluster.slurm]\npartition = "{lab.partition}"\nslurm_conf = "{lab.slurm_conf}"\n'
            f'python = "{python}"\ncontroller_host = "{lab.controller_address}"\nlab_dir = "{state_dir}"\n'
            f'time_limit = ""\nnode_workdir = "{work_dir}/{{job_id}}/{{node}}"\n'
            "allocate_timeout_s = 90\nreplace_timeout_s = 90\nagent_start_timeout_s = 60\n"
        )
    if backend == "ssh":
        hosts = ", ".join(f'"{n.name}={n.ip}"' for n in lab.nodes)
        spares = ", ".join(f'"{s}"' for s in ssh_spares)
        return (
            f'[cluster.ssh]\nhosts = [{hosts}]\nspares = [{spares}]\nknown_hosts = "{lab.known_hosts}"\n'
            f'key_file = "{lab.ssh_key}"\nuser = "{JOB_USER}"\npython = "{python}"\n'
            f'controller_host = "{lab.controller_address}"\nlab_dir = "{state_dir}"\n'
            f'remote_dir = "{work_dir}/{{node}}"\nprobe_timeout_s = 2.0\n'
        )
    raise ValueError(f"the lab runs jobs through 'slurm' or 'ssh', not {backend!r}")


def reference_job(backend: str, lab: LabStatus, *, work_dir: Path, cache_dir: Path, name: str = "",
                  steps: int = 400, rollouts: int = 2, spares: int = 0, warm: bool = False,
                  ssh_spares: list[str] | None = None) -> str:
    """job.toml text of the reference GRPO job on ``lab`` through ``backend`` (``slurm``/``ssh``).

    ``work_dir``: where agents keep their files on the nodes (shared filesystem); ``cache_dir``:
    the warm-start cache the role workers share (``RLCTL_CACHE``); ``ssh_spares``: inventory
    hosts marked as spares.
    """
    env = {**UCX_ENV, "RLCTL_CACHE": str(cache_dir)}
    role_env = "env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }"
    cluster = _cluster_table(backend, lab, work_dir, ssh_spares or [], lab.state_dir)
    return _JOB.format(name=name or f"lab{backend}", steps=steps, backend=backend, cluster=cluster,
                       role_env=role_env, rollouts=rollouts, spares=spares, warm="true" if warm else "false")
