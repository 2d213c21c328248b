"""The env-call queue on its own: turns handed to env workers, answered once, retried on failure,
expired with a silent worker, and decided per ``on_error``."""

from __future__ import annotations

from rlctl.core.envcalls import EnvCalls, answer_deadline_s, lease_s
from rlctl.core.spec import EnvSpec


def call(episode: str, actions: list[str]) -> dict:
    return {"episode": episode, "sample": {"ground_truth": "4"}, "actions": actions}


def test_a_turn_goes_to_one_env_worker_and_its_answer_to_its_rollout_once() -> None:
    queue = EnvCalls()
    queue.submit("r1", [call("a", []), call("b", ["x"])])
    taken = queue.dispatch("env-0", "w1", 8, now=0.0)
    assert [(c["episode"], c["turn"]) for c in taken] == [("a", 0), ("b", 1)]
    assert queue.dispatch("env-1", "w2", 8, now=0.1) == []  # held by w1
    assert queue.complete("w2", [{"episode": "a", "turn": 0, "observation": "hi"}], now=0.2) == 0  # not its call
    assert queue.complete("w1", [{"episode": "a", "turn": 0, "observation": "hi", "reward": 0.0, "done": False}], 0.3) == 1
    ready, missing = queue.answers("r1", ["a", "b"])
    assert ready == {"a": {"observation": "hi", "reward": 0.0, "done": False}} and missing == []
    assert queue.answers("r1", ["a"]) == ({}, ["a"])  # handed over once; asked again it is unknown


def test_a_retried_request_keeps_the_turns_progress_and_a_newer_turn_replaces_the_older() -> None:
    queue = EnvCalls()
    queue.submit("r1", [call("a", ["x"])])
    queue.dispatch("env-0", "w1", 8, now=0.0)
    queue.submit("r1", [call("a", ["x"])])  # the same request again
    assert queue.calls["a"].holder_wid == "w1"
    queue.submit("r2", [call("a", [])])  # the episode restarted on another rollout
    assert queue.calls["a"].turn == 0 and queue.calls["a"].holder_wid is None
    assert queue.answers("r1", ["a"]) == ({}, ["a"])


def test_an_error_is_retried_on_any_worker_then_answered_as_an_error() -> None:
    queue = EnvCalls(on_error="retry", retries=1)
    queue.submit("r1", [call("a", ["x"])])
    queue.dispatch("env-0", "w1", 8, now=0.0)
    queue.complete("w1", [{"episode": "a", "turn": 1, "error": "ValueError: boom"}], now=0.1)
    assert [(f.error, f.action, f.slot) for f in queue.take_failures()] == [("ValueError: boom", "retry", "env-0")]
    assert queue.answers("r1", ["a"]) == ({}, [])  # still open
    assert queue.dispatch("env-1", "w2", 8, now=0.2)[0]["episode"] == "a"
    queue.complete("w2", [{"episode": "a", "turn": 1, "error": "timed out after 1 s"}], now=0.3)
    assert [f.action for f in queue.take_failures()] == ["score"]
    ready, _ = queue.answers("r1", ["a"])
    assert ready["a"]["error"] == "timed out after 1 s"


def test_on_error_score_answers_the_first_error() -> None:
    queue = EnvCalls(on_error="score", retries=5)
    queue.submit("r1", [call("a", [])])
    queue.dispatch("env-0", "w1", 8, now=0.0)
    queue.complete("w1", [{"episode": "a", "turn": 0, "error": "RuntimeError: no"}], now=0.1)
    assert queue.answers("r1", ["a"])[0]["a"]["error"] == "RuntimeError: no"


def test_a_silent_worker_loses_its_calls_and_a_replaced_one_at_once() -> None:
    queue = EnvCalls(retries=3, lease_s=5.0)
    queue.submit("r1", [call("a", []), call("b", [])])
    queue.dispatch("env-0", "w1", 1, now=0.0)
    queue.dispatch("env-1", "w2", 1, now=0.0)
    assert queue.backlog == 0
    queue.expire(now=4.0)
    assert queue.backlog == 0
    queue.dispatch("env-1", "w2", 0, now=5.5)  # w2 still reports; w1 has been silent 5.5 s
    assert {f.slot for f in queue.take_failures()} == {"env-0"}
    assert queue.backlog == 1
    queue.dispatch("env-1", "w3", 0, now=5.6)  # env-1 restarted: w2's call fails at once
    assert [f.slot for f in queue.take_failures()] == ["env-1"] and queue.backlog == 2


def test_the_rollouts_deadline_covers_every_attempt() -> None:
    spec = EnvSpec(turn_timeout_s=3.0, retries=2)
    assert answer_deadline_s(spec) >= 3 * lease_s(spec) > 3 * 3.0
    assert answer_deadline_s(EnvSpec(turn_timeout_s=3.0, on_error="score")) < answer_deadline_s(spec)
