"""What the job does next at a moment: open a round, start a held-out evaluation, or finish.
Decided once, for the live controller's tick and the simulator's pipeline. Pure.

A round opens for the published version once the round before it closed, and the first one once
the first weights exist (the trainer published them: no rollout could generate before); it waits
while a held-out evaluation of an older version runs (that version stays served until it is scored). A
held-out evaluation starts at every ``eval_every``-th version and at the last one. The job
finishes once the last version is published and its held-out evaluation, if the job has one, is
scored.
"""

from __future__ import annotations

from rlctl.core.model import JobModel
from rlctl.core.rounds import RoundScheduler


def round_due(model: JobModel, rounds: RoundScheduler) -> int | None:
    """The version whose round should open now, or None."""
    version = model.published_version
    if version >= model.total_steps or model.productive_since is None:
        return None
    held_out = rounds.held_out
    if held_out is not None and held_out.version < version:
        return None
    current = rounds.round
    if current is None or (current.closed and current.step < version):
        return version
    return None


def held_out_due(model: JobModel, rounds: RoundScheduler) -> int | None:
    """The version whose held-out evaluation should start now, or None."""
    version = model.published_version
    return version if rounds.held_out_due(version, final=version >= model.total_steps) else None


def finished(model: JobModel, rounds: RoundScheduler) -> bool:
    """The last version is published and no held-out evaluation is still running."""
    return model.published_version >= model.total_steps and rounds.held_out is None
