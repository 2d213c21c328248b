"""A failing reward function (issue 30, item 4): the window over its recent calls, the rule that
says it is failing or gives up on it, and the ledger, which counts no time of it as productive."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlctl.core.ettr import without_progress
from rlctl.core.events import Event, EventKind, event
from rlctl.core.model import JobModel
from rlctl.core.reward_health import MIN_CALLS, WINDOW_CALLS, RewardCalls, judge
from tests.core.test_policy import running_job

FUNCTION = "my_reward.py:compute_score"


def failed(at: float, error: str = "ValueError: cannot parse") -> Event:
    return event(EventKind.REWARD_FUNCTION_FAILED, at, function=FUNCTION, item_id=f"i{at}", prompt_id="p",
                 error=error, on_error="zero")


def stored(at: float, returned: int, failed_too: int = 0) -> Event:
    scores = [{"item_id": f"ok{at}-{i}", "reward": 1.0, "correct": True} for i in range(returned)]
    scores += [{"item_id": f"bad{at}-{i}", "reward": 0.0, "correct": False, "failed": True} for i in range(failed_too)]
    return event(EventKind.REWARDS_STORED, at, scores=scores)


def producing_job() -> JobModel:
    """A running job whose first weights exist at t=2 (from then on its time is productive)."""
    model = running_job()
    model.apply(event(EventKind.WEIGHTS_PUBLISHED, 2.0, version=0, slot="trainer-0", source={}))
    return model


def apply_judged(model: JobModel, events: list[Event], bound: int = 0) -> list[Event]:
    """Apply ``events`` one by one, each followed by what the rule decides (as the controller does)."""
    decided = []
    for ev in events:
        model.apply(ev)
        judgement = judge(model.reward_calls, bound, ev.at)
        for extra in judgement.events:
            model.apply(extra)
        decided += judgement.events
    return decided


def test_most_of_the_window_failing_is_said_once_naming_the_function_count_and_last_error() -> None:
    model = producing_job()
    decided = apply_judged(model, [failed(10.0 + i) for i in range(MIN_CALLS - 1)])
    assert decided == [], "fewer than MIN_CALLS calls say nothing yet"
    decided = apply_judged(model, [failed(20.0, "timed out after 5 s"), failed(21.0, "timed out after 5 s")])
    [failing] = decided
    assert failing.type == EventKind.REWARD_FUNCTION_FAILING and failing.at == 20.0
    assert failing.data["function"] == FUNCTION and failing.data["failures"] == MIN_CALLS
    assert failing.data["calls"] == MIN_CALLS and failing.data["consecutive"] == MIN_CALLS
    assert failing.data["last_error"] == "timed out after 5 s"
    assert FUNCTION in failing.data["reason"] and "8 of the last 8 calls failed" in failing.data["reason"]
    assert model.reward_calls.failing and model.reward_calls.failing_since == 20.0


def test_half_the_window_failing_is_not_most_and_recovery_needs_a_healthy_window() -> None:
    model = producing_job()
    assert apply_judged(model, [stored(3.0, 4)] + [failed(4.0 + i) for i in range(4)]) == []  # 4 of 8: not most
    [failing] = apply_judged(model, [failed(9.0)])  # 5 of 9
    assert failing.type == EventKind.REWARD_FUNCTION_FAILING
    # 5 failures of 17 calls is under half but above a quarter: still failing, no flapping back and forth.
    assert apply_judged(model, [stored(10.0, 8)]) == [] and model.reward_calls.failing
    [recovered] = apply_judged(model, [stored(11.0, WINDOW_CALLS)])
    assert recovered.type == EventKind.REWARD_FUNCTION_RECOVERED and recovered.data["failures"] == 0
    assert not model.reward_calls.failing


def test_the_job_gives_up_after_max_consecutive_failures_and_a_returned_call_resets_the_count() -> None:
    calls = RewardCalls()
    for i in range(MIN_CALLS + 1):
        calls.failed(FUNCTION, "ValueError: cannot parse", float(i), 0.0)
    assert judge(calls, MIN_CALLS + 2, 20.0).give_up is None
    assert judge(calls, 0, 20.0).give_up is None, "0: never"
    calls.returned(1, 0.0)
    for i in range(MIN_CALLS + 1):
        calls.failed(FUNCTION, "ValueError: cannot parse", 30.0 + i, 0.0)
    assert judge(calls, MIN_CALLS + 2, 40.0).give_up is None, "the count restarted after the returned call"
    calls.failed(FUNCTION, "timed out after 5 s", 41.0, 0.0)
    reason = judge(calls, MIN_CALLS + 2, 42.0).give_up
    assert reason == (f"failed: reward function {FUNCTION} failed {MIN_CALLS + 2} calls in a row "
                      f"([reward] max_consecutive_failures = {MIN_CALLS + 2}); last error: timed out after 5 s")


def test_giving_up_before_the_window_could_judge_still_says_the_function_is_failing() -> None:
    model = producing_job()
    decided = apply_judged(model, [failed(10.0), failed(11.0)])
    assert decided == []
    model.apply(failed(12.0))
    judgement = judge(model.reward_calls, 3, 12.0)
    assert [e.type for e in judgement.events] == [EventKind.REWARD_FUNCTION_FAILING]
    assert judgement.give_up is not None and "failed 3 calls in a row" in judgement.give_up


def test_failed_scores_stored_as_zeros_are_not_counted_as_returned_calls() -> None:
    model = producing_job()
    apply_judged(model, [failed(3.0 + i) for i in range(3)] + [stored(6.0, 0, failed_too=3)])
    assert model.reward_calls.consecutive_failures == 3 and model.reward_calls.calls == 3
    apply_judged(model, [stored(7.0, 2)])
    assert model.reward_calls.consecutive_failures == 0 and model.reward_calls.calls == 5


def test_the_time_a_reward_function_fails_is_lost_not_productive_and_productive_again_once_it_recovers() -> None:
    model = producing_job()
    model.apply(stored(10.0, 4))  # productive until t=10
    apply_judged(model, [failed(10.0 + i) for i in range(MIN_CALLS)])  # the 8th failure at t=17: failing
    ledger = model.ledger
    assert ledger.seconds["productive"] == pytest.approx(8.0)  # 2..10
    assert ledger.seconds["lost"] == pytest.approx(7.0)  # 10..17: since the window's first failure
    live = model.live_ledger(47.0)
    assert live.seconds["productive"] == pytest.approx(8.0) and live.seconds["lost"] == pytest.approx(37.0)
    assert live.ettr() == pytest.approx(8.0 / 46.0)
    apply_judged(model, [stored(50.0, WINDOW_CALLS)])  # healthy again at t=50
    model.apply(event(EventKind.STEP_TRAINED, 60.0, step=0, metrics={}))
    assert model.ledger.seconds["productive"] == pytest.approx(18.0) and model.ledger.seconds["lost"] == pytest.approx(40.0)
    assert sum(model.ledger.seconds.values()) == pytest.approx(model.ledger.wall)


def test_a_resumed_controller_rebuilds_the_same_window_and_ledger_from_the_journal() -> None:
    model = producing_job()
    journal: list[Event] = []
    for ev in [stored(3.0, 2)] + [failed(4.0 + i) for i in range(MIN_CALLS + 2)]:
        model.apply(ev)
        journal.append(ev)
        judged = judge(model.reward_calls, 0, ev.at).events
        for extra in judged:
            model.apply(extra)
        journal += judged
    rebuilt = producing_job()
    for ev in journal:
        rebuilt.apply(ev)
    assert rebuilt.reward_calls.as_dict() == model.reward_calls.as_dict()
    assert rebuilt.ledger.seconds == pytest.approx(model.ledger.seconds)


weights = st.dictionaries(st.sampled_from(("productive", "detection", "recovery", "lost")), st.floats(0.01, 1.0),
                          min_size=1)


@given(weights)
def test_without_progress_keeps_the_split_whole_and_nothing_productive(split: dict[str, float]) -> None:
    moved = without_progress(split)
    assert sum(moved.values()) == pytest.approx(sum(split.values()))
    assert "productive" not in moved
    assert all(moved.get(k, 0.0) == split[k] for k in ("detection", "recovery") if k in split)
