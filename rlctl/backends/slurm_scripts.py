"""The sbatch scripts of a job: one array per role (and the spares), and the per-node agent task.

Role: what ``SlurmBackend.allocate`` submits and ``rlctl launch --dry-run`` prints, rendered from
the Jinja templates in ``templates/`` (or the copy a wheel installs). Pure: rendering writes nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from rlctl.backends.base import AllocationRequest, BackendError

SPARE_ROLE = "spare"
ROLE_TEMPLATE = "slurm_role.sbatch.j2"
TASK_TEMPLATE = "slurm_agent_task.sh.j2"


def template_dir_candidates() -> list[Path]:
    """Where the sbatch templates are: ``templates/`` of a source checkout, then the copy a wheel
    installs under ``<prefix>/share/rlctl/templates`` (pyproject's data-files)."""
    return [Path(__file__).resolve().parents[2] / "templates", Path(sys.prefix) / "share" / "rlctl" / "templates"]


def find_template_dir(candidates: list[Path] | None = None) -> Path:
    """The first candidate folder that holds both templates; a ``BackendError`` naming every
    folder tried when none does."""
    candidates = template_dir_candidates() if candidates is None else candidates
    for candidate in candidates:
        if (candidate / ROLE_TEMPLATE).is_file() and (candidate / TASK_TEMPLATE).is_file():
            return candidate
    raise BackendError("the sbatch templates are missing: looked for "
                       f"{ROLE_TEMPLATE} and {TASK_TEMPLATE} in {', '.join(map(str, candidates))}")


@dataclass(frozen=True)
class RenderedScript:
    """One script as ``allocate`` would write it: where, how it is run, and its text."""

    path: Path
    runner: str  # "sbatch --parsable" for a role's array; "" for the task script its srun runs
    text: str


class SbatchScripts:
    """Renders a job's sbatch scripts for the job's partition, account, time limit and options."""

    def __init__(self, slurm_dir: Path, partition: str, account: str, time_limit: str, python: str,
                 exclude: frozenset[str], extra_sbatch: tuple[str, ...], template_dir: Path | None = None) -> None:
        self.slurm_dir = slurm_dir
        self.partition = partition
        self.account = account
        self.time_limit = time_limit
        self.python = python
        self.exclude = exclude
        self.extra_sbatch = extra_sbatch
        self._templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(template_dir or find_template_dir())),
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
            autoescape=False,
        )

    @property
    def task_script(self) -> Path:
        return self.slurm_dir / "agent-task.sh"

    @property
    def zipapp_path(self) -> Path:
        return self.slurm_dir / "agent.pyz"

    def job_name(self, job_id: str, role: str) -> str:
        return f"rlctl-{job_id}-{role}"

    def render_role_script(self, job_id: str, role: str, count: int, gpus: int, *,
                           exclude: frozenset[str] = frozenset(), nodelist: tuple[str, ...] = ()) -> str:
        """The sbatch script for ``count`` nodes of ``role``. Pure."""
        return self._templates.get_template(ROLE_TEMPLATE).render(
            job_id=job_id, role=role, count=count, gpus=gpus, job_name=self.job_name(job_id, role),
            slurm_dir=str(self.slurm_dir), partition=self.partition, account=self.account,
            time_limit=self.time_limit, exclude=sorted(exclude | self.exclude), nodelist=list(nodelist),
            extra_sbatch=list(self.extra_sbatch), task_script=str(self.task_script),
        )

    def render_task_script(self, job_id: str) -> str:
        """The per-node srun task (agent starter). Pure."""
        return self._templates.get_template(TASK_TEMPLATE).render(
            job_id=job_id, slurm_dir=str(self.slurm_dir), python=self.python, zipapp=str(self.zipapp_path),
        )

    def role_counts(self, request: AllocationRequest) -> list[tuple[str, int, int]]:
        roles = [(r, n, request.gpus_per_node.get(r, 0)) for r, n in request.nodes_by_role.items() if n > 0]
        if request.spares > 0:
            spare_gpus = max(request.gpus_per_node.values(), default=0)
            roles.append((SPARE_ROLE, request.spares, spare_gpus))
        return roles

    def rendered(self, request: AllocationRequest) -> list[RenderedScript]:
        """Every sbatch script ``allocate`` would submit, then the task script. Pure."""
        scripts = [RenderedScript(self.slurm_dir / f"{role}.sbatch", "sbatch --parsable",
                                  self.render_role_script(request.job_id, role, count, gpus, exclude=request.exclude))
                   for role, count, gpus in self.role_counts(request)]
        return [*scripts, RenderedScript(self.task_script, "", self.render_task_script(request.job_id))]

    def plan_text(self, request: AllocationRequest) -> str:
        """Every sbatch script ``allocate`` would submit, plus the task script, each under a
        ``### path`` line. No side effects."""
        parts = []
        for script in self.rendered(request):
            parts.append(f"### {script.path}  ({script.runner})\n" if script.runner else f"### {script.path}\n")
            parts.append(script.text)
        return "\n".join(parts)
