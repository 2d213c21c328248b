"""What the job does next, which the live controller's tick and the simulator's pipeline both ask:
a round opens once the one before it closed and waits for a running held-out evaluation of an
older version; a held-out evaluation starts at every ``eval_every``-th version and the last; the
job finishes only after the last version's evaluation is scored."""

from __future__ import annotations

from rlctl.core import job_moves as moves
from rlctl.core.model import JobModel
from rlctl.core.round_state import PromptRef, SchedulerConfig
from rlctl.core.rounds import RoundScheduler


def job(total_steps: int = 4) -> tuple[JobModel, RoundScheduler]:
    config = SchedulerConfig(batch_prompts=2, group_size=2, max_new_tokens=8, tail_enabled=False, short_max_tokens=4,
                             overprovision=0.0, long_batch=2, seed=1, held_out_every=2)
    scheduler = RoundScheduler(config, [PromptRef(f"p{i}", (1, 2), {}) for i in range(8)],
                               [PromptRef(f"h{i}", (3, 4), {}) for i in range(2)])
    model = JobModel(job_id="j")
    model.total_steps = total_steps
    model.productive_since = 0.5  # the trainer published the first weights
    return model, scheduler


def test_no_round_opens_before_the_first_weights_exist() -> None:
    model, scheduler = job()
    model.productive_since = None
    assert moves.round_due(model, scheduler) is None


def test_a_round_opens_once_the_one_before_it_closed_for_a_newer_version() -> None:
    model, scheduler = job()
    assert moves.round_due(model, scheduler) == 0
    scheduler.start_round(0, 1.0)
    assert moves.round_due(model, scheduler) is None  # open
    scheduler.round.closed = True
    assert moves.round_due(model, scheduler) is None  # closed, but version 0 is not trained yet
    model.published_version = 1
    assert moves.round_due(model, scheduler) == 1


def test_held_out_evaluations_at_every_eval_every_th_version_hold_the_next_round_back() -> None:
    model, scheduler = job()
    model.published_version = 1
    assert moves.held_out_due(model, scheduler) is None
    model.published_version = 2
    assert moves.held_out_due(model, scheduler) == 2
    scheduler.start_held_out(2, 1.0)
    assert moves.held_out_due(model, scheduler) is None  # one at a time
    assert moves.round_due(model, scheduler) == 2  # its own version is served anyway
    model.published_version = 3
    assert moves.round_due(model, scheduler) is None  # version 2 stays served until it is scored


def test_the_job_finishes_after_the_last_versions_evaluation() -> None:
    model, scheduler = job(total_steps=3)
    model.published_version = 3
    assert moves.round_due(model, scheduler) is None
    assert moves.held_out_due(model, scheduler) == 3  # the last version is evaluated though 3 % 2 != 0
    scheduler.start_held_out(3, 1.0)
    assert not moves.finished(model, scheduler)
    scheduler.held_out = None
    assert moves.finished(model, scheduler)

