"""`rlctl launch --dry-run` prints the rendered sbatch scripts verbatim at any width, piped, and
`--out DIR` writes them (and plan.json) as a whole folder or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.backends.plans import render_launch
from rlctl.cli.outdir import OutDirError, write_folder
from rlctl.spec_loader import load_job_file
from tests.hf_models import gsm8k_data, tiny_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-gsm8k-slurm.toml"
SCRIPT_NAMES = ["trainer.sbatch", "rollout.sbatch", "reward.sbatch", "spare.sbatch", "agent-task.sh"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8B Slurm example with a tiny model and data set in the 8B's and GSM8K's place."""
    text = EXAMPLE.read_text()
    text = text.replace("/shared/models/Qwen3-8B", str(tiny_model()))
    text = text.replace("/shared/data/gsm8k", str(gsm8k_data(train_rows=600)))
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_text(text)
    return path


def _launch(*args: str, columns: int = 40, home: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it with its output piped (not a terminal), ``COLUMNS`` set."""
    env = {"RLCTL_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "rlctl.cli", "launch", *args], env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def test_piped_dry_run_at_40_columns_prints_every_script_verbatim_and_out_writes_them(job: Path, tmp_path: Path) -> None:
    expected = render_launch(load_job_file(job)).files
    assert sorted(expected) == sorted(SCRIPT_NAMES)
    out = tmp_path / "plans" / "run1"  # its parent is made too
    result = _launch(str(job), "--dry-run", "--out", str(out), home=tmp_path / "jobs")
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    for name, text in expected.items():
        for line in text.splitlines():
            assert line in printed, f"{name}: {line!r} is not printed as one line"
        assert text in result.stdout, f"{name} is not printed as one block"
    assert any(len(line) > 100 for line in printed)  # the srun line and the comments kept whole at 40 columns
    assert not (tmp_path / "jobs").exists()

    assert f"wrote {', '.join(SCRIPT_NAMES)}, plan.json to {out}" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([*SCRIPT_NAMES, "plan.json"])
    assert not [p for p in out.parent.iterdir() if p != out]  # no staging folder left beside it
    for name in SCRIPT_NAMES:
        assert (out / name).read_text() == expected[name]
        check = subprocess.run(["bash", "-n", str(out / name)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, f"{name}: {check.stderr}"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["job"] == "qwen3-8b-gsm8k" and plan["backend"] == "slurm" and plan["nodes"] == 32
    assert sorted(plan["files"]) == sorted(SCRIPT_NAMES) and plan["plan"].rstrip("\n") == result.stdout.rstrip("\n")
    assert plan["checks"]["reward"] == "gsm8k"


def test_out_refuses_a_non_empty_folder_a_file_and_use_without_dry_run(job: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine\n")
    result = _launch(str(job), "--dry-run", "--out", str(full), home=tmp_path / "jobs")
    assert result.returncode == 2 and f"--out {full}: the folder is not empty" in result.stderr, result.stderr
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine\n"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = _launch(str(job), "--dry-run", "--out", str(a_file / "out"), home=tmp_path / "jobs")
    assert result.returncode == 2 and f"{a_file} is not a folder" in result.stderr, result.stderr
    result = _launch(str(job), "--out", str(tmp_path / "new"), home=tmp_path / "jobs")
    assert result.returncode == 2 and "use it with --dry-run" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "full"]  # nothing made, no job started


def test_out_refuses_an_unwritable_folder(job: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes into read-only folders (root with CAP_DAC_OVERRIDE)")
        result = _launch(str(job), "--dry-run", "--out", str(locked / "out"), home=tmp_path / "jobs")
        assert result.returncode == 2 and f"--out {locked / 'out'}: cannot create it, {locked} is not writable" in \
            result.stderr, result.stderr
        result = _launch(str(job), "--dry-run", "--out", str(locked), home=tmp_path / "jobs")
        assert result.returncode == 2 and f"--out {locked}: the folder is not writable" in result.stderr, result.stderr
        assert not list(locked.iterdir())
    finally:
        locked.chmod(0o755)


def test_a_write_that_fails_midway_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new" / "deeper" / "out"
    files = {"a.sh": "true\n", "b" * 300: "too long a name\n", "c.sh": "true\n"}
    with pytest.raises(OutDirError, match=rf"--out {target}: cannot write it: File name too long"):
        write_folder(target, files, "--out")
    assert not list(tmp_path.iterdir())  # neither the target, its staging folder nor the parents it made
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OutDirError):
        write_folder(empty, files, "--out")
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and not list(empty.iterdir())
    written = write_folder(empty, {"a.sh": "true\n"}, "--out")
    assert written == [empty / "a.sh"] and (empty / "a.sh").read_text() == "true\n"


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs sysfs, which refuses new folders even to root")
def test_a_folder_the_system_refuses_is_named_in_the_error(tmp_path: Path) -> None:
    target = Path("/sys/rlctl-dry-run-out")
    with pytest.raises(OutDirError, match=rf"--out {target}: "):
        write_folder(target, {"a.sh": "true\n"}, "--out")
    assert not target.exists()
