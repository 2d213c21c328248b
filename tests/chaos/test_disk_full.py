"""The job's state disk fills up, on a real local job whose ``RLCTL_HOME`` is a small tmpfs: the
journal or a checkpoint cannot be written, and the controller stops at once with the reason where
``rlctl status`` shows it (outside the full disk), leaving the journal whole and the workers running;
once there is room, ``rlctl resume`` goes on from the journal and the job ends with every step
trained and nothing lost (a step trained twice is one replayed from a checkpoint). Needs root (it mounts the tmpfs)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    kill_everything_under,
    pid_alive,
    print_figures,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for the state disk needs root")]

STEPS = 40


@pytest.fixture()
def small_disk(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(home)], check=True)
    try:
        yield home
    finally:
        kill_everything_under(tmp_path)
        subprocess.run(["umount", "-l", str(home)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """A file that takes all of ``disk``'s room but ``leave_bytes``."""
    filler = disk / "filler"
    with filler.open("wb") as out:
        block = b"\0" * (1 << 20)
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


@pytest.mark.parametrize(("what_fails", "leave_bytes"), [("journal", 0), ("checkpoint", 1 << 20)])
def test_a_full_state_disk_stops_the_controller_cleanly_and_resume_goes_on_losing_nothing(
        tmp_path: Path, small_disk: Path, what_fails: str, leave_bytes: int) -> None:
    job_file = write_job(tmp_path, name="fulldisk", steps=STEPS, spares=1, checkpoint_every=2)
    launched = rlctl_json(small_disk, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    controller = int(launched["controller_pid"])
    try:
        wait_for(lambda: (s := status(small_disk, job)) and (s["job"]["checkpoint_step"] or 0) >= 2, 120,
                 "the first checkpoint")
        filler = fill(small_disk, leave_bytes)  # the journal's next write fails, or (1 MiB left) the next checkpoint
        filled = time.monotonic()
        wait_for(lambda: not pid_alive(controller), 120, "the controller to stop when the disk is full")
        stopped_s = time.monotonic() - filled
        note = jobdir.stop_note.read_text()
        assert "could not be written" in note and what_fails in note and f"rlctl resume {job}" in note, note
        offline = status(small_disk, job)
        assert not offline["controller"]["live"] and "could not be written" in offline["controller"]["stopped"]
        assert offline["job"]["state"] in ("running", "recovering") and offline["job"]["step"] < STEPS
        shown = rlctl(small_disk, "status", job).stdout
        assert "could not be written" in shown
        with sqlite3.connect(f"file:{jobdir.journal}?mode=ro", uri=True) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        workers = [n for n in offline["nodes"] if n["worker_state"] == "running"]
        assert workers, "the workers were stopped: they must keep running for the resume"

        filler.unlink()
        resumed = time.monotonic()
        rlctl(small_disk, "resume", job)
        assert not jobdir.stop_note.exists()
        done = wait_for(lambda: (s := status(small_disk, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                        180, "the job to end after the resume")
        resume_to_end_s = time.monotonic() - resumed
    finally:
        rlctl(small_disk, "stop", job, check=False)
    assert done["job"]["state"] == "succeeded", done["job"]
    events = list(Journal(jobdir.journal, readonly=True).read())
    trained = [e.data["step"] for e in events if e.type == "StepTrained"]
    assert sorted(set(trained)) == list(range(STEPS)), trained
    formed = [e.data["step"] for e in events if e.type == "BatchFormed"]
    assert len(formed) == len(set(formed)) == STEPS
    assert done["job"]["ledger_s"].get("lost", 0.0) == 0.0
    started = [e.data for e in events if e.type == "ControllerStarted"]
    assert [s["resumed"] for s in started] == [False, True]
    failed_checkpoints = [e.data for e in events if e.type == "CheckpointFailed"]
    assert bool(failed_checkpoints) == (what_fails == "checkpoint"), failed_checkpoints
    report = rlctl_json(small_disk, "report", job)
    assert report["trajectories_lost"] == 0
    print_figures(f"disk full ({what_fails})", stop_after_fill_s=round(stopped_s, 1),
                  step_at_stop=offline["job"]["step"], resume_to_end_s=round(resume_to_end_s, 1),
                  steps_trained=len(set(trained)), steps_retrained=len(trained) - len(set(trained)),
                  trajectories_stored=report["trajectories_stored"], trajectories_lost=report["trajectories_lost"])
