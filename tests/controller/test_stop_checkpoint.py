"""The controller's side of the stop checkpoint, with its data ops and a recording shell: while an
operator's stop is under way the trainer (and only it) is asked to checkpoint, every rank of a
group finishes the step one of them began, the answer or the wait's end is journaled once, a
checkpoint write killed half way leaves no folder behind, a stop with no controller says what it
could not save, and the API refuses bad stop fields by name."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlctl.controller.api import ApiHandlers, ApiServer, BadRequest
from rlctl.controller.jobdir import JobDir
from rlctl.controller.offline import stop_offline
from rlctl.controller.ops import DataOps
from rlctl.controller.stopsave import StopSave, tidy_checkpoints
from rlctl.controller.store import Journal
from rlctl.core.checkpoint_names import retired_name, staged_name
from rlctl.core.events import Event, EventKind, event
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.spec import EnvSpec, parse_spec
from rlctl.core.states import WorkerState
from rlctl.core.stopsave import describe, plan_stop_save
from rlctl.lab.reference_jobs import write_job
from tests.core.shells import RecordingShell
from tests.core.test_policy import running_job
from tests.core.test_rounds import make_scheduler


class TickingClock:
    """Each look at it moves it on by ``tick`` seconds (the wait polls it)."""

    def __init__(self, now: float, tick: float = 0.25) -> None:
        self.now, self.tick = now, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _stopping_job(trainers: int = 1, checkpoint: bool = True, timeout_s: float = 30.0, connected: bool = True,
                  hung: str = "") -> tuple[DataOps, Orchestrator, StopSave, list[Event]]:
    """A job whose step 0 batch is formed and handed to trainer-0, then stopped by the operator at
    time 2.5 (the wait's clock moves 0.25 s a look from there)."""
    model = running_job(trainers=trainers)
    scheduler = make_scheduler(tail=False)
    shell = RecordingShell(model)
    spec = SimpleNamespace(env=EnvSpec(), multi_turn=False, colocated=False, reward={"on_error": "zero", "helper_backlog": 0},
                           fault_tolerance=SimpleNamespace(min_silence_s=3.0, stall_s=0.0))
    orc = Orchestrator(spec, model, scheduler, None, shell)  # type: ignore[arg-type]
    shell.commit(scheduler.start_round(0, 1.0))
    journal: list[Event] = []
    stop_save = StopSave(model, lambda payload: journal.extend(orc.record(payload)), lambda node: connected,
                         hung=lambda now: hung, clock=TickingClock(2.5))
    ops = DataOps(orc, lambda now: None, stop_save)
    rollout, reward = model.slots["rollout-0"], model.slots["reward-0"]
    items = ops.op_rollout_get_work(rollout, {"capacity": 64}, 2.0)["items"]
    ops.op_rollout_submit(rollout, {"results": [{"item_id": i["item_id"], "response_tokens": [5, 2], "truncated": False,
                                                 "weights_version": 0} for i in items]}, 2.1)
    scored = ops.op_reward_get_work(reward, {"capacity": 64}, 2.2)["items"]
    ops.op_reward_submit(reward, {"scores": [{"item_id": i["item_id"], "reward": 1.0, "correct": True}
                                             for i in scored]}, 2.3)
    assert "samples" in ops.op_trainer_get_batch(model.slots["trainer-0"], {"step": 0}, 2.4)
    leader = model.slots["trainer-0"]
    shell.commit([event(EventKind.WORKER_PHASE, 2.4, slot=leader.slot, wid=leader.wid, phase="training", step=0)])
    plan = plan_stop_save(model, checkpoint, timeout_s)
    orc.request_stop("stopped by the operator")
    stop_save.begin(plan, 2.5)
    return ops, orc, stop_save, journal


def _stop_events(journal: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in journal if e.type == EventKind.STOP_CHECKPOINT]


def test_the_trainer_alone_is_asked_for_the_stop_checkpoint_and_its_answer_is_journaled_once() -> None:
    ops, orc, stop_save, journal = _stopping_job()
    trainer, rollout = orc.model.slots["trainer-0"], orc.model.slots["rollout-0"]
    assert stop_save.pending
    assert ops.op_rollout_get_work(rollout, {"capacity": 8}, 3.0) == {"stop": True}
    assert ops.op_job_wait(rollout, {}, 3.0) == {"stop": True}
    asked = {"stop": True, "checkpoint": True, "checkpoint_step": -1}
    assert ops.op_trainer_get_batch(trainer, {"step": 1}, 3.0) == asked
    assert ops.op_trainer_get_stream(trainer, {"step": 1, "have": 0}, 3.0) == asked
    assert ops.op_job_wait(trainer, {}, 3.0) == asked
    ops.op_trainer_checkpointed(trainer, {"step": 1, "path": "/ck/step-000001"}, 3.1)
    ops.op_trainer_stop_saved(trainer, {"step": 1, "written": True, "write_s": 0.2}, 3.2)
    ops.op_trainer_stop_saved(trainer, {"step": 1, "written": True, "write_s": 0.2}, 3.3)  # a repeat changes nothing
    [saved] = _stop_events(journal)
    assert saved["outcome"] == "written" and saved["step"] == 1 and saved["checkpoint_step"] == 1
    assert saved["seconds"] == 0.7 and saved["write_s"] == 0.2 and saved["path"] == "/ck/step-000001"
    assert not stop_save.pending and asyncio.run(stop_save.wait()) == saved
    assert ops.op_trainer_get_batch(trainer, {"step": 1}, 3.4) == {"stop": True}  # nothing asked any more


def test_every_rank_of_a_group_trains_the_step_one_of_them_began_before_the_stop() -> None:
    ops, orc, _, _ = _stopping_job(trainers=2)
    leader, rank1 = orc.model.slots["trainer-0"], orc.model.slots["trainer-1"]
    assert "samples" in ops.op_trainer_get_batch(rank1, {"step": 0}, 3.0)  # the batch rank 0 is training
    assert ops.op_trainer_get_batch(leader, {"step": 1}, 3.1)["checkpoint"] is True
    assert ops.op_trainer_get_batch(rank1, {"step": 1}, 3.1)["checkpoint"] is True


def test_a_failed_write_and_a_version_saved_already_are_said_as_such() -> None:
    ops, orc, _, journal = _stopping_job()
    ops.op_trainer_stop_saved(orc.model.slots["trainer-0"], {"step": 1, "written": False, "error": "OSError: disk full"}, 3.0)
    [failed] = _stop_events(journal)
    assert failed["outcome"] == "failed" and "disk full" in failed["reason"]
    ops, orc, _, journal = _stopping_job()
    ops.op_trainer_stop_saved(orc.model.slots["trainer-0"], {"step": 0, "written": False}, 3.0)
    assert _stop_events(journal)[0]["outcome"] == "already-saved"


def test_stop_now_asks_nothing_and_says_so() -> None:
    ops, orc, stop_save, journal = _stopping_job(checkpoint=False)
    assert not stop_save.pending
    assert ops.op_trainer_get_batch(orc.model.slots["trainer-0"], {"step": 1}, 3.0) == {"stop": True}
    [skipped] = _stop_events(journal)
    assert skipped["outcome"] == "skipped" and skipped["reason"].startswith("--now")


def test_the_wait_ends_at_the_timeout_when_the_trainer_is_lost_or_hung_or_when_cancelled() -> None:
    _, _, stop_save, journal = _stopping_job(timeout_s=1.0)
    result = asyncio.run(stop_save.wait())
    assert result is not None and result["outcome"] == "timed-out" and result["seconds"] == 1.0
    assert "within 1 s" in result["reason"] and _stop_events(journal) == [result]

    _, orc, stop_save, journal = _stopping_job(connected=False)
    assert asyncio.run(stop_save.wait())["outcome"] == "trainer-lost"  # type: ignore[index]

    _, orc, stop_save, journal = _stopping_job()
    leader = orc.model.slots["trainer-0"]
    assert leader.life is not None
    leader.life.move(WorkerState.EXITED, 3.0, "exited")
    assert asyncio.run(stop_save.wait())["outcome"] == "trainer-lost"  # type: ignore[index]

    _, _, stop_save, journal = _stopping_job(hung="no progress for 9.0s in phase training")
    hung = asyncio.run(stop_save.wait())
    assert hung is not None and hung["outcome"] == "trainer-lost" and "hung (no progress" in hung["reason"]

    _, _, stop_save, journal = _stopping_job()
    stop_save.cancel("rlctl stop --now while the trainer was saving")
    assert asyncio.run(stop_save.wait())["outcome"] == "cancelled"  # type: ignore[index]
    assert len(_stop_events(journal)) == 1


def test_a_write_killed_half_way_leaves_no_folder_and_a_retired_checkpoint_comes_back(tmp_path: Path) -> None:
    for name in ("step-000005", staged_name("step-000007", "4242"), staged_name("step-000007", "group"),
                 retired_name("step-000005", "11"), retired_name("step-000003", "12")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    done = tidy_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-000003", "step-000005"]
    assert (tmp_path / "step-000003" / "config.json").is_file()  # killed between a rewrite's two renames
    assert len(done) == 4 and tidy_checkpoints(tmp_path) == [] and tidy_checkpoints(tmp_path / "absent") == []


class ReleasingBackend:
    """A backend whose nodes are released at once (the offline stop's only use of it)."""

    name = "local"

    def __init__(self) -> None:
        self.released: list[str] = []

    async def adopt(self, nodes: list[Any]) -> None:
        return None

    async def release(self, nodes: list[Any]) -> None:
        self.released.extend(n.name for n in nodes)

    async def close(self) -> None:
        return None


def test_a_stop_with_no_controller_says_nothing_could_be_saved_and_what_is_lost(tmp_path: Path) -> None:
    jobdir = JobDir(tmp_path / "jobs" / "stopsave-1")
    jobdir.create("")
    journal = Journal(jobdir.journal)
    journal.take_over()
    journal.append([event("JobSubmitted", 1.0, job_id=jobdir.job_id, spec_file="x", backend="local", policy="role", steps=20),
                    event("JobStateChanged", 1.1, state="starting", reason="allocating nodes"),
                    event("JobStateChanged", 1.2, state="running", reason="every role has a running worker"),
                    *[event("WeightsPublished", 2.0 + v, version=v, slot="trainer-0", source={}) for v in range(8)],
                    event("Checkpointed", 6.0, step=5, path=str(jobdir.checkpoints / "step-000005"))])
    journal.close()
    (jobdir.checkpoints / "step-000005").mkdir()
    (jobdir.checkpoints / staged_name("step-000007", "999")).mkdir()  # the trainer was killed writing step 7

    spec = parse_spec(tomllib.loads(write_job(tmp_path, steps=20).read_text()), "job.toml")
    result = asyncio.run(stop_offline(jobdir, spec, ReleasingBackend(), "stopped by the operator (no controller ran)"))  # type: ignore[arg-type]
    assert result.state == "stopped" and result.step == 7 and result.checkpoint is not None
    assert result.checkpoint["outcome"] == "no-controller" and result.checkpoint["step"] == 7
    assert result.checkpoint["checkpoint_step"] == 5
    assert describe(result.checkpoint) == ("no checkpoint written: the controller is gone, and only it can ask the "
                                           "trainer to save; last checkpoint is step 5; steps 6-7 are not saved")
    assert sorted(p.name for p in jobdir.checkpoints.iterdir()) == ["step-000005"]
    events = list(Journal(jobdir.journal, readonly=True).read(types=("StopCheckpoint",)))
    assert [e.data for e in events] == [result.checkpoint]


def test_the_api_refuses_a_stop_with_bad_checkpoint_fields_by_name() -> None:
    asked: list[tuple[str, bool, float | None]] = []

    def stop(reason: str, checkpoint: bool, timeout_s: float | None) -> dict[str, Any]:
        asked.append((reason, checkpoint, timeout_s))
        return {"already": False}

    server = ApiServer(Path("/nonexistent/api.sock"), ApiHandlers(
        status=dict, diagnostics=lambda since: {}, stop=stop, inject=None,  # type: ignore[arg-type]
        injections=list, cancel=lambda fault_id: {}))
    for request, said in (({"op": "stop", "checkpoint": "yes"}, "checkpoint is a boolean, got a string"),
                          ({"op": "stop", "timeout_s": 0}, "timeout_s is in [1, 86400] seconds, got 0"),
                          ({"op": "stop", "timeout_s": "soon"}, "timeout_s is a number, got a string")):
        with pytest.raises(BadRequest, match=re.escape(said)):
            asyncio.run(server.dispatch(request))
    assert not asked
    answer = asyncio.run(server.dispatch({"op": "stop", "checkpoint": False, "timeout_s": 5}))
    assert answer == {"ok": True, "stop": {"already": False}}
    assert asked == [("stopped by the operator", False, 5.0)]
    asyncio.run(server.dispatch({"op": "stop", "reason": "maintenance"}))
    assert asked[-1] == ("maintenance", True, None)


def test_a_restarted_trainer_replays_up_to_the_published_step_before_the_stop_checkpoint() -> None:
    ops, orc, _, _ = _stopping_job()
    orc.model.apply(event("WeightsPublished", 2.45, version=1, slot="trainer-0", source={}))
    trainer = orc.model.slots["trainer-0"]
    ops._served_groups.clear()  # a new trainer: nothing handed to it yet
    assert "samples" in ops.op_trainer_get_batch(trainer, {"step": 0}, 3.0)  # the retained batch of step 0
    assert ops.op_trainer_get_batch(trainer, {"step": 1}, 3.1)["checkpoint"] is True
