"""The job spec: the quickstart validates; every file of the bad-job corpus fails naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlctl.cli.app import app
from rlctl.core.spec import SpecError, spec_reference_markdown
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted((ROOT / "tests" / "spec_corpus").glob("*.toml"))


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <message>'"
    return first.removeprefix("# expect: ")


def test_quickstart_is_valid() -> None:
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    assert spec.backend == "local"
    assert spec.roles["trainer"].nodes == 1 and spec.roles["rollout"].nodes == 2
    assert spec.nodes_needed == 5
    assert spec.rollout.tail_batching.enabled


def test_the_worker_template_is_on_by_default_on_every_backend(tmp_path: Path) -> None:
    local = (ROOT / "examples" / "quickstart.toml").read_text()
    assert load_job_file(ROOT / "examples" / "quickstart.toml").worker_template
    chosen = tmp_path / "off.toml"
    chosen.write_text(local.replace("[cluster]\n", "[cluster]\nworker_template = false\n", 1))
    assert not load_job_file(chosen).worker_template
    for example in ("qwen3-8b-gsm8k-slurm.toml",):
        spec = load_job_file(ROOT / "examples" / example)
        assert spec.backend == "slurm" and spec.worker_template


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_bad_job_files_name_the_file_and_key(path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_job_file(path)
    text = str(info.value)
    assert str(path) in text, "the error must name the file"
    assert expected_message(path) in text


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "many.toml"
    bad.write_text('[job]\nname = "x"\nsteps = 0\nbogus = 1\n[fault_tolerance]\npolicy = "nope"\n')
    with pytest.raises(SpecError) as info:
        load_job_file(bad)
    keys = {p.key for p in info.value.problems}
    assert keys == {"job.steps", "job.bogus", "fault_tolerance.policy"}


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_job_file(tmp_path / "absent.toml")


def test_launch_refuses_bad_file_and_starts_nothing(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["launch", str(ROOT / "tests/spec_corpus/zero_trainers.toml"), "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "roles.trainer.nodes" in result.output
    assert not any(tmp_path.iterdir()), "nothing may be created for an invalid job"


def test_dry_run_prints_plan_without_creating_a_job(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["launch", str(ROOT / "examples/quickstart.toml"), "--dry-run", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "node01" in result.output and "rollout" in result.output
    assert not any(tmp_path.iterdir())


def test_docs_job_spec_is_current() -> None:
    assert (ROOT / "docs" / "job-spec.md").read_text() == spec_reference_markdown(), (
        "docs/job-spec.md is stale: run `rlctl spec-doc > docs/job-spec.md`"
    )


def test_reference_job_template_scales_the_work_of_a_step(tmp_path: Path) -> None:
    from rlctl.lab.reference_jobs import write_job

    small = load_job_file(write_job(tmp_path / "a", name="small"))
    large = load_job_file(write_job(tmp_path / "b", name="large", step_scale=8))
    assert (large.rollout.batch_prompts, large.rollout.worker_batch) == (8 * small.rollout.batch_prompts,
                                                                        8 * small.rollout.worker_batch)
    assert large.rollout.group_size == small.rollout.group_size
    with pytest.raises(ValueError, match="step_scale"):
        write_job(tmp_path / "c", step_scale=0)
