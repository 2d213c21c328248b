"""The stop checkpoint's decisions: whom a stop asks to save, what the operator is told, which trainer
requests are still served while the job stops, and which hidden folders a killed write left."""

from __future__ import annotations

import pytest

from rlctl.core.checkpoint_names import leftover_of, retired_name, staged_name, step_folder
from rlctl.core.detector import Detector, DetectorConfig
from rlctl.core.events import event
from rlctl.core.model import JobModel
from rlctl.core.states import WorkerState
from rlctl.core.stopsave import (
    StopSaveOutcome,
    StopSavePlan,
    describe,
    keeps_serving,
    leader_alive,
    leader_hung,
    outcome_data,
    plan_stop_save,
)
from tests.core.test_policy import running_job


def trained(model: JobModel, version: int, checkpoint: int | None = None) -> JobModel:
    for v in range(1, version + 1):
        model.apply(event("WeightsPublished", 2.0 + v, version=v, slot="trainer-0", source={"addr": "x"}))
    if checkpoint is not None:
        model.apply(event("Checkpointed", 20.0, step=checkpoint, path=f"/ck/{step_folder(checkpoint)}"))
    return model


def test_a_stop_asks_the_live_trainer_to_save_the_version_it_holds() -> None:
    plan = plan_stop_save(trained(running_job(), 7, checkpoint=5), checkpoint=True, timeout_s=30.0)
    assert plan.wait and plan.step == 7 and plan.checkpoint_step == 5 and plan.timeout_s == 30.0
    # Already checkpointed: still asked (it may be finishing a step); it answers at once when nothing is new.
    again = plan_stop_save(trained(running_job(), 5, checkpoint=5), checkpoint=True, timeout_s=30.0)
    assert again.wait and again.step == 5


@pytest.mark.parametrize(("setup", "why"), [
    ("now", "--now"),
    ("nothing trained", "no step was trained yet"),
    ("trainer restarting", "not running: trainer-0"),
    ("a rank restarting", "not running: trainer-1"),
    ("not placed", "no trainer placed yet"),
])
def test_a_stop_asks_nobody_when_no_whole_trainer_can_save(setup: str, why: str) -> None:
    model = running_job(trainers=2) if setup == "a rank restarting" else running_job()
    if setup != "nothing trained":
        trained(model, 3)
    if setup in ("trainer restarting", "a rank restarting"):
        slot = model.slots["trainer-1" if setup == "a rank restarting" else "trainer-0"]
        assert slot.life is not None
        slot.life.move(WorkerState.FAILED, 30.0, "crashed")
    if setup == "not placed":
        model.slots["trainer-0"].node = None
    plan = plan_stop_save(model, checkpoint=setup != "now", timeout_s=30.0)
    assert not plan.wait and why in plan.reason


def test_a_trainer_on_its_first_step_is_asked_to_save_it() -> None:
    model = running_job()
    slot = model.slots["trainer-0"]
    model.apply(event("WorkerPhase", 3.0, slot="trainer-0", wid=slot.wid, phase="training", step=0))
    assert plan_stop_save(model, checkpoint=True, timeout_s=30.0).wait


def test_the_leader_is_alive_only_while_connected_and_live() -> None:
    model = running_job(trainers=2)
    assert leader_alive(model, connected=True) and not leader_alive(model, connected=False)
    leader = model.slots["trainer-0"]
    assert leader.life is not None
    leader.life.move(WorkerState.EXITED, 30.0, "exited")
    assert not leader_alive(model, connected=True)


def test_a_frozen_trainer_is_judged_hung_by_the_detector_s_own_bounds() -> None:
    model = running_job()
    leader = model.slots["trainer-0"]
    model.apply(event("WorkerPhase", 2.0, slot="trainer-0", wid=leader.wid, phase="training", step=3))
    detector = Detector(DetectorConfig(1.0, 8.0, 2.0, True, {"training": 8.0}, 0.35, 10.0, poll_silence_s=4.0))
    assert leader_hung(model, detector, asked_at=2.0, now=6.0) == ""
    assert "no progress for 9.0s in phase training" in leader_hung(model, detector, asked_at=2.0, now=11.0)
    model.apply(event("WorkerPhase", 11.0, slot="trainer-0", wid=leader.wid, phase="waiting-for-batch", step=4))
    assert leader_hung(model, detector, asked_at=12.0, now=15.0) == ""  # it still polls
    assert "stopped polling" in leader_hung(model, detector, asked_at=12.0, now=17.0)


def _said(outcome: StopSaveOutcome, step: int, last: int, reason: str = "why") -> str:
    plan = StopSavePlan(True, step, last, 30.0, "")
    return describe(outcome_data(outcome, plan, last, 1.25, reason))


def test_the_operator_is_told_what_was_saved_and_what_was_not() -> None:
    assert _said(StopSaveOutcome.WRITTEN, 7, 7) == "checkpoint of step 7 written in 1.2 s"
    assert _said(StopSaveOutcome.ALREADY_SAVED, 5, 5) == "step 5 was already checkpointed; nothing more to save"
    assert _said(StopSaveOutcome.NO_CONTROLLER, 7, 5, "the controller is gone") == (
        "no checkpoint written: the controller is gone; last checkpoint is step 5; steps 6-7 are not saved")
    assert _said(StopSaveOutcome.TIMED_OUT, 6, 5, "late") == (
        "no checkpoint written: late; last checkpoint is step 5; step 6 is not saved")
    assert _said(StopSaveOutcome.SKIPPED, 3, -1, "--now") == (
        "no checkpoint written: --now; the job has no checkpoint; steps 1-3 are not saved")
    assert _said(StopSaveOutcome.SKIPPED, 0, -1, "no step was trained yet").endswith("the job has no checkpoint")
    assert StopSaveOutcome.WRITTEN.saved and not StopSaveOutcome.TIMED_OUT.saved


def test_an_outcome_names_the_step_the_trainer_reported() -> None:
    data = outcome_data(StopSaveOutcome.WRITTEN, StopSavePlan(True, 7, 5, 30.0, ""), 8, 0.5, "ok", step=8, write_s=0.1)
    assert data == {"outcome": "written", "step": 8, "checkpoint_step": 8, "seconds": 0.5, "timeout_s": 30.0,
                    "reason": "ok", "write_s": 0.1}


def test_while_stopping_a_rank_gets_only_replays_and_the_parts_another_rank_already_got() -> None:
    assert not keeps_serving(step=7, have=0, served=0, published=7)  # nobody began step 7: every rank stops
    assert keeps_serving(step=7, have=0, served=4, published=7)  # rank 1 asks for the batch rank 0 trains
    assert keeps_serving(step=7, have=4, served=8, published=7)  # streamed parts
    assert not keeps_serving(step=7, have=8, served=8, published=7)
    assert keeps_serving(step=6, have=0, served=0, published=7)  # a restarted trainer replays up to step 7


def test_hidden_folders_of_a_killed_write_are_recognised_by_their_step() -> None:
    folder = step_folder(7)
    assert folder == "step-000007"
    assert leftover_of(staged_name(folder, "1234")) == ("step-000007", False)
    assert leftover_of(staged_name(folder, "group")) == ("step-000007", False)
    assert leftover_of(retired_name(folder, "99")) == ("step-000007", True)
    for other in ("step-000007", ".step-000007", ".step-x.tmp-1", ".step-000007.tmp-", ".cache", "notes.tmp-1"):
        assert leftover_of(other) is None, other
