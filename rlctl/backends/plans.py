"""What ``launch --dry-run`` shows of a job's allocation, rendered from the cluster table and the
allocation request alone: no backend is built, nothing is read or written. Each backend's own
``plan_text`` renders through the same functions, so the dry run shows what ``allocate`` does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.backends.base import AllocationRequest
from rlctl.core.launchplan import plan
from rlctl.core.spec import JobSpec

# The scripts name paths under the job's directory, which exists once the job is launched: a dry
# run shows them under this one.
DRY_RUN_JOB_DIR = Path("/nonexistent-dry-run")


@dataclass(frozen=True)
class AllocationRendering:
    """The backend's view of an allocation (the sbatch scripts on Slurm), and the files that
    view holds, by file name."""

    text: str
    files: dict[str, str]


@dataclass(frozen=True)
class LaunchRendering:
    """What ``launch --dry-run`` shows: the launch plan's lines and the backend's rendering of
    its allocation."""

    plan_lines: list[str]
    allocation: AllocationRendering

    @property
    def backend_text(self) -> str:
        return self.allocation.text

    @property
    def files(self) -> dict[str, str]:
        return self.allocation.files


def render_launch(spec: JobSpec, job_dir: Path = DRY_RUN_JOB_DIR) -> LaunchRendering:
    """The launch plan and the backend's rendering of its allocation. Pure."""
    launch_plan = plan(spec)
    request = launch_plan.allocation(f"{spec.name}-(dry-run)")
    return LaunchRendering(launch_plan.lines(), render_allocation(spec.backend, spec.cluster, request, job_dir))


def render_allocation(backend: str, cluster: dict[str, Any], request: AllocationRequest,
                      job_dir: Path) -> AllocationRendering:
    """``backend``'s rendering of ``request`` for a job whose directory would be ``job_dir``."""
    if backend == "local":
        from rlctl.backends.local import local_plan_text

        return AllocationRendering(local_plan_text(int(cluster["nodes"]), int(cluster["gpus_per_node"]), request), {})
    if backend == "ssh":
        from rlctl.backends.ssh import inventory_from_config, ssh_plan_text

        return AllocationRendering(ssh_plan_text(inventory_from_config(cluster), frozenset(), request), {})
    from rlctl.backends.slurm import scripts_from_config

    scripts = scripts_from_config(cluster, job_dir)
    return AllocationRendering(scripts.plan_text(request), {s.path.name: s.text for s in scripts.rendered(request)})
