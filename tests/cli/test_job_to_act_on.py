"""Which job a command acts on: jobs are listed in launch order (not by their folder's mtime, which
moves whenever a file is made in it), and a command that changes a job refuses to guess when several
jobs run under one state folder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import typer

from rlctl.cli.common import resolve_job, resolve_job_to_act_on
from rlctl.controller.jobdir import JobDir, list_jobs
from rlctl.controller.predecessor import this_process


def make_job(root: Path, job_id: str) -> JobDir:
    jobdir = JobDir(root / job_id)
    jobdir.create("[job]\n")
    jobdir.journal.write_bytes(b"")
    return jobdir


def record_controller(jobdir: JobDir, running: bool) -> None:
    me = this_process()
    jobdir.write_controller(me.as_record() | ({} if running else {"process_started": me.started + 1}))


def test_jobs_keep_their_launch_order_while_they_write_files(tmp_path: Path) -> None:
    first = make_job(tmp_path, "twin-20261202-100000-aaaa")
    time.sleep(0.01)
    second = make_job(tmp_path, "twin-20261202-100000-0000")
    (first.path / "controller.json").write_text("{}")  # the older job's folder is now the newest by mtime
    assert [j.job_id for j in list_jobs(tmp_path)] == [first.job_id, second.job_id]
    assert resolve_job(None, str(tmp_path)) == second


def test_a_command_that_changes_a_job_names_the_running_ones_rather_than_guess(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [make_job(tmp_path, f"twin-20261202-10000{i}-abcd") for i in range(3)]
    record_controller(jobs[0], running=True)
    record_controller(jobs[1], running=True)
    record_controller(jobs[2], running=False)  # a killed controller's record: its pid is another process now
    with pytest.raises(typer.Exit) as refused:
        resolve_job_to_act_on(None, str(tmp_path), "stop")
    assert refused.value.exit_code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert jobs[0].job_id in said and jobs[1].job_id in said and jobs[2].job_id not in said and "--job" in said
    assert resolve_job_to_act_on(jobs[0].job_id, str(tmp_path), "stop") == jobs[0]
    record_controller(jobs[1], running=False)
    assert resolve_job_to_act_on(None, str(tmp_path), "stop") == jobs[2]
