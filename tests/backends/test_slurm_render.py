"""Golden-file tests pinning the rendered sbatch scripts and the agent task script.

Regenerate after an intended template change with: RLCTL_UPDATE_GOLDEN=1 pytest tests/backends
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlctl.backends.base import AllocationRequest
from rlctl.backends.slurm import SlurmBackend

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("RLCTL_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with RLCTL_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from its golden file (RLCTL_UPDATE_GOLDEN=1 to accept)"


@pytest.fixture
def backend() -> SlurmBackend:
    return SlurmBackend(job_dir=Path("/jobs/demo"), partition="gpu", account="rl", time_limit="04:00:00",
                        exclude=frozenset({"bad07"}), extra_sbatch=("--qos=high",))


REQUEST = AllocationRequest(job_id="demo", nodes_by_role={"trainer": 2, "rollout": 4, "reward": 1}, spares=1,
                            gpus_per_node={"trainer": 8, "rollout": 8, "reward": 0}, exclude=frozenset({"bad03"}))


@pytest.mark.parametrize("role,count,gpus", [("trainer", 2, 8), ("rollout", 4, 8), ("reward", 1, 0)])
def test_role_scripts_match_golden(backend: SlurmBackend, role: str, count: int, gpus: int) -> None:
    check_golden(f"{role}.sbatch", backend.scripts.render_role_script("demo", role, count, gpus, exclude=REQUEST.exclude))


def test_replacement_script_with_exclude_and_nodelist(backend: SlurmBackend) -> None:
    check_golden("replace-exclude.sbatch",
                 backend.scripts.render_role_script("demo", "rollout", 1, 8, exclude=frozenset({"node03", "node05"})))
    check_golden("replace-nodelist.sbatch",
                 backend.scripts.render_role_script("demo", "rollout", 1, 8, nodelist=("node09",)))


def test_task_script_matches_golden(backend: SlurmBackend) -> None:
    check_golden("agent-task.sh", backend.scripts.render_task_script("demo"))


def test_plan_text_matches_golden(backend: SlurmBackend) -> None:
    check_golden("plan.txt", backend.plan_text(REQUEST))


def test_plan_has_one_array_per_role_and_spares(backend: SlurmBackend) -> None:
    plan = backend.plan_text(REQUEST)
    for role in ("trainer", "rollout", "reward", "spare"):
        assert f"--job-name=rlctl-demo-{role}" in plan
    assert plan.count("#SBATCH --no-requeue") == 4
    assert plan.count("#SBATCH --exclusive") == 4
    assert "--exclude=bad03,bad07" in plan
    assert "secret" not in plan.replace("the job secret", "")  # never the secret itself


def test_minimal_script_has_no_empty_options() -> None:
    script = SlurmBackend(job_dir=Path("/j")).scripts.render_role_script("x", "reward", 1, 0)
    assert "--partition" not in script and "--gres" not in script and "--exclude" not in script
    assert "#SBATCH --array=0-0" in script
