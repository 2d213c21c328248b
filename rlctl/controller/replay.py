"""Rebuild a job model from its journal without a controller (for `status`, `report`, tests)."""

from __future__ import annotations

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.model import JobModel
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.spec_loader import load_job_dir_spec


def replay_model(jobdir: JobDir) -> JobModel:
    """The job's model as of the last journaled event. Read-only; safe while a controller runs."""
    spec = load_job_dir_spec(jobdir)
    model = JobModel(job_id=jobdir.job_id)
    model.scheduler = RoundScheduler(config_from_spec(spec), [])
    journal = Journal(jobdir.journal, readonly=True)
    try:
        for ev in journal.read():
            model.apply(ev)
    finally:
        journal.close()
    return model
