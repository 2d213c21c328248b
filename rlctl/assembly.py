"""The assembly of a job: the backend its spec names, its workload and the lab's fault injector.
The CLI and the controller's process entry point (``rlctl.controller_process``) call these; the
layers below them are handed what is built here. (What ``launch --dry-run`` prints is rendered
without building anything: ``rlctl.backends.plans``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from rlctl.backends.base import Backend, FaultInjector
from rlctl.controller.seam import Workload
from rlctl.core.spec import JobSpec


class HasPath(Protocol):
    """A job directory, or anything with the ``path`` a backend keeps its state under."""

    @property
    def path(self) -> Path: ...


def make_backend(spec: JobSpec, jobdir: HasPath) -> Backend:
    """The backend the spec names, configured from its ``[cluster.<backend>]`` table."""
    cluster = spec.cluster
    if spec.backend == "local":
        from rlctl.backends.local import LocalBackend

        return LocalBackend(jobdir.path / "nodes", capacity=int(cluster["nodes"]), gpus_per_node=int(cluster["gpus_per_node"]))
    if spec.backend == "ssh":
        from rlctl.backends.ssh import SshBackend

        return SshBackend.from_config(cluster, jobdir.path, lab_fault_injector(cluster))
    from rlctl.backends.slurm import SlurmBackend

    return SlurmBackend.from_config(cluster, jobdir.path, lab_fault_injector(cluster))


def make_workload(spec: JobSpec) -> Workload:
    """The workload the controller runs (the reference GRPO roles on the spec's model and data)."""
    from rlctl.workload.seam import GrpoWorkload

    return GrpoWorkload(spec)


def lab_fault_injector(cluster: dict[str, Any]) -> FaultInjector | None:
    """The lab's fault injector when the cluster table names an ``rlctl lab`` (``lab_dir``)."""
    lab_dir = cluster.get("lab_dir")
    if not lab_dir:
        return None
    from rlctl.lab.inject import LabFaultInjector

    return LabFaultInjector(Path(str(lab_dir)))
