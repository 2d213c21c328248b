"""Work dispatch through the controller's data ops: a worker the recovery is stopping gets no new
items (a chaos run stalled when the round's items went to a rollout mid-stop, then to nobody)."""

from __future__ import annotations

from types import SimpleNamespace

from rlctl.controller.ops import DataOps
from rlctl.core.events import Event
from rlctl.core.states import WorkerState
from tests.core.test_policy import running_job
from tests.core.test_rounds import make_scheduler


def _ops() -> tuple[DataOps, SimpleNamespace]:
    model = running_job()
    scheduler = make_scheduler(tail=False)
    committed: list[Event] = []
    controller = SimpleNamespace(model=model, scheduler=scheduler, stopping=False, routed_away=set(),
                                 commit_decided=committed.extend, weights_source=lambda version, exclude_slot: None)
    scheduler.start_round(0, 1.0)
    return DataOps(controller), controller  # type: ignore[arg-type]


def test_a_running_rollout_gets_items_and_a_stopping_one_does_not() -> None:
    ops, c = _ops()
    rollout_0, rollout_1 = c.model.slots["rollout-0"], c.model.slots["rollout-1"]
    assert ops.op_rollout_get_work(rollout_0, {"capacity": 2}, 2.0)["items"]
    rollout_1.life.move(WorkerState.STOPPING, 2.0, "stop requested")
    assert ops.op_rollout_get_work(rollout_1, {"capacity": 2}, 2.1) == {"wait_s": 0.2}
    assert not [s for s in c.scheduler.round.samples.values() if s.wid == rollout_1.wid]

