"""Work dispatch through the controller's data ops: a worker the recovery is stopping gets no new
items (a chaos run stalled when the round's items went to a rollout mid-stop, then to nobody)."""

from __future__ import annotations

from types import SimpleNamespace

from rlctl.controller.ops import DataOps
from rlctl.core.events import Event
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.spec import EnvSpec
from rlctl.core.states import WorkerState
from tests.core.shells import RecordingShell
from tests.core.test_policy import running_job
from tests.core.test_rounds import make_scheduler


def _ops(tail: bool = False) -> tuple[DataOps, Orchestrator]:
    model = running_job()
    scheduler = make_scheduler(tail=tail)
    shell = RecordingShell(model)
    spec = SimpleNamespace(env=EnvSpec(), multi_turn=False, colocated=False, reward={"on_error": "zero", "helper_backlog": 0},
                           fault_tolerance=SimpleNamespace(min_silence_s=3.0, stall_s=0.0))
    orchestrator = Orchestrator(spec, model, scheduler, None, shell)  # type: ignore[arg-type]
    scheduler.start_round(0, 1.0)
    return DataOps(orchestrator, lambda now: None), orchestrator


def test_a_running_rollout_gets_items_and_a_stopping_one_does_not() -> None:
    ops, c = _ops()
    rollout_0, rollout_1 = c.model.slots["rollout-0"], c.model.slots["rollout-1"]
    assert ops.op_rollout_get_work(rollout_0, {"capacity": 2}, 2.0)["items"]
    rollout_1.life.move(WorkerState.STOPPING, 2.0, "stop requested")
    assert ops.op_rollout_get_work(rollout_1, {"capacity": 2}, 2.1) == {"wait_s": 0.2}
    assert not [s for s in c.scheduler.round.samples.values() if s.wid == rollout_1.wid]



def test_samples_sent_with_a_poll_close_a_full_short_round_and_the_rest_are_cancelled() -> None:
    ops, c = _ops(tail=True)
    rollout, reward = c.model.slots["rollout-0"], c.model.slots["reward-0"]
    rnd = c.scheduler.round
    assert rnd.kind == "short" and rnd.target_groups == 4 and len(rnd.prompt_ids) == 6  # 4 prompts x 1.5
    items = ops.op_rollout_get_work(rollout, {"capacity": 64}, 2.0)["items"]
    finished_prompts = rnd.prompt_ids[:4]
    finished = [{"item_id": i["item_id"], "response_tokens": [5, 2], "truncated": False, "weights_version": 0}
                for i in items if i["prompt_id"] in finished_prompts]
    running = [i["item_id"] for i in items if i["prompt_id"] not in finished_prompts]
    reply = ops.op_rollout_poll(rollout, {"item_ids": running, "results": finished}, 2.1)
    assert reply == {"cancel": []}  # stored, but not scored yet: the batch is not full
    to_score = ops.op_reward_get_work(reward, {"capacity": 64}, 2.2)["items"]
    assert {i["item_id"] for i in to_score} == {r["item_id"] for r in finished}
    ops.op_reward_submit(reward, {"scores": [{"item_id": i["item_id"], "reward": 1.0, "correct": True}
                                             for i in to_score]}, 2.3)
    assert rnd.closed and c.scheduler.batch_for(0).prompt_ids == finished_prompts
    assert sorted(ops.op_rollout_poll(rollout, {"item_ids": running}, 2.4)["cancel"]) == sorted(running)
    assert list(c.scheduler.pool)[:2] == rnd.prompt_ids[4:]  # the in-flight extras went back to the pool


def _scored_items(ops: DataOps, c: Orchestrator) -> list[dict]:
    rollout, reward = c.model.slots["rollout-0"], c.model.slots["reward-0"]
    items = ops.op_rollout_get_work(rollout, {"capacity": 4}, 2.0)["items"]
    ops.op_rollout_submit(rollout, {"results": [{"item_id": i["item_id"], "response_tokens": [5, 2], "truncated": False,
                                                 "weights_version": 0} for i in items]}, 2.1)
    return ops.op_reward_get_work(reward, {"capacity": 4}, 2.2)["items"]


def _with_reward_policy(ops: DataOps, c: Orchestrator, on_error: str) -> list[str]:
    stops: list[str] = []
    ops.orc.spec = SimpleNamespace(reward={"on_error": on_error}, env=EnvSpec(), multi_turn=False, colocated=False)  # type: ignore[assignment]
    ops.orc.request_stop = stops.append  # type: ignore[method-assign,assignment]
    return stops


def test_a_reward_function_error_is_journaled_and_scored_zero() -> None:
    ops, c = _ops()
    stops = _with_reward_policy(ops, c, "zero")
    items = _scored_items(ops, c)
    scores = [{"item_id": i["item_id"], "reward": 0.0, "correct": False} for i in items]
    scores[0].update(error="ValueError: cannot parse", function="rewards.py:compute_score")
    journaled: list[Event] = []
    c.shell.commit = journaled.extend  # type: ignore[method-assign,assignment]
    reply = ops.op_reward_submit(c.model.slots["reward-0"], {"scores": scores}, 2.3)
    assert reply == {"accepted": len(items)} and not stops
    [failure] = [e for e in journaled if e.type == "RewardFunctionFailed"]
    assert failure.type == "RewardFunctionFailed" and failure.data["item_id"] == items[0]["item_id"]
    assert failure.data["function"] == "rewards.py:compute_score" and failure.data["on_error"] == "zero"
    assert failure.data["prompt_id"] == items[0]["prompt_id"]
    rnd = c.scheduler.round
    assert rnd.samples[items[0]["item_id"]].reward == 0.0


def test_a_reward_function_error_fails_the_job_when_asked() -> None:
    ops, c = _ops()
    stops = _with_reward_policy(ops, c, "fail")
    items = _scored_items(ops, c)
    scores = [{"item_id": i["item_id"], "reward": 0.0, "correct": False,
               "error": "timed out after 5 s", "function": "rewards.py:compute_score"} for i in items]
    assert ops.op_reward_submit(c.model.slots["reward-0"], {"scores": scores}, 2.3) == {"accepted": 0}
    assert len(stops) == 1 and stops[0].startswith("failed: reward function rewards.py:compute_score on ")
    assert "timed out after 5 s" in stops[0]


def test_a_warm_standby_scores_a_chunk_of_a_long_reward_queue_and_is_still_a_standby() -> None:
    ops, c = _ops()
    ops.orc.spec = SimpleNamespace(reward={"on_error": "zero", "helper_backlog": 2}, env=EnvSpec(),  # type: ignore[assignment]
                                   multi_turn=False, colocated=False)
    rollout, standby = c.model.slots["rollout-0"], c.model.slots["standby-0"]
    items = ops.op_rollout_get_work(rollout, {"capacity": 8}, 2.0)["items"]
    ops.op_rollout_submit(rollout, {"results": [{"item_id": i["item_id"], "response_tokens": [5, 2], "truncated": False,
                                                 "weights_version": 0} for i in items]}, 2.1)
    assert len(items) == 8
    # Four may score (the reward worker, two rollouts, the standby): the standby takes a quarter.
    reply = ops.op_standby_wait(standby, {"trainer_state_step": -1}, 2.2)
    assert reply["standby"] and [s["item_id"] for s in reply["score"]] == [i["item_id"] for i in items[:2]]
    scores = [{"item_id": s["item_id"], "reward": 1.0, "correct": True} for s in reply["score"]]
    assert ops.op_reward_submit(standby, {"scores": scores}, 2.3) == {"accepted": 2}
    shares = []
    while "score" in (reply := ops.op_standby_wait(standby, {"trainer_state_step": -1}, 2.4)):
        shares.append(len(reply["score"]))
        ops.op_reward_submit(standby, {"scores": [{"item_id": s["item_id"], "reward": 1.0} for s in reply["score"]]}, 2.5)
    assert shares == [2, 1, 1, 1], "an even share while at least helper_backlog samples wait, then none"
    assert c.scheduler.scoring_backlog() == 1 and reply["standby"]


def test_reward_calls_failing_in_a_row_are_said_and_fail_the_job_at_max_consecutive_failures() -> None:
    """Every score of a batch failed: the zeros are stored (``on_error = "zero"``) but counted as
    failed calls, not returned ones; the journal says the function is failing, naming it, the count
    and the last error; at ``[reward] max_consecutive_failures`` the job is asked to stop as failed."""
    ops, c = _ops()
    stops = _with_reward_policy(ops, c, "zero")
    ops.orc.spec.reward["max_consecutive_failures"] = 5  # type: ignore[index]
    rollout, reward = c.model.slots["rollout-0"], c.model.slots["reward-0"]
    items = ops.op_rollout_get_work(rollout, {"capacity": 16}, 2.0)["items"]
    ops.op_rollout_submit(rollout, {"results": [{"item_id": i["item_id"], "response_tokens": [5, 2], "truncated": False,
                                                 "weights_version": 0} for i in items]}, 2.1)
    to_score = ops.op_reward_get_work(reward, {"capacity": 2}, 2.2)["items"]
    ok = [{"item_id": i["item_id"], "reward": 1.0, "correct": True} for i in to_score]
    assert ops.op_reward_submit(reward, {"scores": ok}, 2.3) == {"accepted": 2} and not stops
    to_score = ops.op_reward_get_work(reward, {"capacity": 16}, 2.4)["items"]
    assert len(to_score) == len(items) - 2 >= 5
    bad = [{"item_id": i["item_id"], "reward": 0.0, "correct": False, "error": "timed out after 5 s",
            "function": "rewards.py:compute_score"} for i in to_score]
    assert ops.op_reward_submit(reward, {"scores": bad}, 2.5) == {"accepted": len(bad)}
    calls = c.model.reward_calls
    assert calls.calls == len(items) and calls.failures == len(bad) == calls.consecutive_failures
    [failing] = [e for e in c.shell.journal if e.type == "RewardFunctionFailing"]
    assert failing.data["function"] == "rewards.py:compute_score" and failing.data["failures"] == len(bad)
    assert failing.data["last_error"] == "timed out after 5 s"
    assert stops == [(f"failed: reward function rewards.py:compute_score failed {len(bad)} calls in a row "
                      "([reward] max_consecutive_failures = 5); last error: timed out after 5 s")]


def test_a_request_re_sent_after_thousands_of_others_gets_its_first_reply_and_runs_once() -> None:
    ops, c = _ops()
    rollout = c.model.slots["rollout-0"]
    runs: list[str] = []
    submit = ops.op_rollout_submit

    def counted_submit(slot, args, now):  # type: ignore[no-untyped-def]
        runs.append(args["results"][0]["item_id"])
        return submit(slot, args, now)

    ops.op_rollout_submit = counted_submit  # type: ignore[method-assign]
    items = ops.handle(rollout, "get-1", "rollout.get_work", {"capacity": 1}, 2.0)["items"]
    results = {"results": [{"item_id": items[0]["item_id"], "response_tokens": [5, 2], "truncated": False,
                            "weights_version": 0}]}
    first = ops.handle(rollout, "submit-1", "rollout.submit", results, 2.1)
    for n in range(5000):  # more than the 4,096 replies the cache once held before clearing itself whole
        ops.handle(rollout, f"poll-{n}", "rollout.poll", {"item_ids": []}, 2.2 + n * 0.01)
    again = ops.handle(rollout, "submit-1", "rollout.submit", results, 60.0)
    assert again == first and runs == [items[0]["item_id"]]


def test_replies_are_forgotten_only_once_nobody_asked_for_them_for_the_keep_window() -> None:
    from rlctl.controller.reply_cache import ReplyCache

    cache = ReplyCache(keep_s=100.0)
    cache.put(("w", "a"), {"n": 1}, 0.0)
    cache.put(("w", "b"), {"n": 2}, 50.0)
    assert cache.get(("w", "a"), 90.0) == {"n": 1}  # asked again: kept another keep window
    cache.put(("w", "c"), {"n": 3}, 160.0)
    assert cache.get(("w", "b"), 160.0) is None and cache.get(("w", "a"), 160.0) == {"n": 1}
    cache.put(("w", "d"), {"n": 4}, 300.0)
    assert len(cache) == 1 and cache.get(("w", "d"), 300.0) == {"n": 4}
