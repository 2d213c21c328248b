"""Reward functions: built-ins, a user's function in each of verl's forms, and the sandbox that
contains a function that raises, hangs or kills its process."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlctl.workload.rewardfn import (
    RewardFunctionError,
    RewardSpec,
    SandboxedScorer,
    ScoreRequest,
    call_function,
    gsm8k_extract,
    load_function,
    normalize,
)

USER_REWARD = textwrap.dedent('''
    import asyncio, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip() == str(ground_truth)), "length": len(solution_str)}

    async def async_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return 0.25

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise RuntimeError("the verifier broke")
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "exit":
            os._exit(3)
        return 1.0
''')


@pytest.fixture()
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def _request(text: str, truth: object = "42", source: str = "openai/gsm8k") -> ScoreRequest:
    return ScoreRequest(source, text, truth, {})


def test_gsm8k_strict_and_flexible() -> None:
    assert gsm8k_extract("37+5=42\n#### 42") == "42"
    assert gsm8k_extract("#### 1,234.") == "1234"
    assert gsm8k_extract("the answer is 42") is None
    assert gsm8k_extract("the answer is 42", flexible=True) == "42"
    gsm8k = load_function(RewardSpec(function="gsm8k"))
    assert call_function(gsm8k, _request("so #### 42"), "gsm8k") == normalize({"score": 1.0, "acc": True, "formatted": True})
    assert call_function(gsm8k, _request("#### 41"), "gsm8k").score == 0.0


def test_math_verify_and_auto_dispatch() -> None:
    auto = load_function(RewardSpec(function="auto"))
    assert call_function(auto, _request(r"The answer is \boxed{\frac{1}{2}}", "0.5", "lighteval/MATH"), "auto").correct
    assert not call_function(auto, _request(r"\boxed{3}", "0.5", "lighteval/MATH"), "auto").correct
    assert call_function(auto, _request("#### 42"), "auto").correct
    task = ScoreRequest("rlctl/task/add", "42", "42", {}, truncated=False)
    assert call_function(auto, task, "auto").score == 1.0
    cut = ScoreRequest("rlctl/task/add", "42", "42", {}, truncated=True)
    assert call_function(auto, cut, "auto").score < 1.0
    with pytest.raises(ValueError, match="no built-in scorer for data_source 'mystery'"):
        call_function(auto, _request("1", source="mystery"), "auto")


def test_user_function_in_every_form(reward_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_file = load_function(RewardSpec(function=f"{reward_file}:compute_score"))
    outcome = call_function(by_file, _request(" 42 "), None)
    assert outcome.score == 1.0 and outcome.correct and outcome.extras == {"length": 4.0}
    verl_form = load_function(RewardSpec(path=str(reward_file)))  # name defaults to compute_score
    assert call_function(verl_form, _request("41"), None).score == 0.0
    monkeypatch.syspath_prepend(str(reward_file.parent))
    by_module = load_function(RewardSpec(function="my_reward:async_score"))
    assert call_function(by_module, _request("x"), None).score == 0.25


def test_load_errors_name_the_function(tmp_path: Path, reward_file: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    cases = {
        RewardSpec(function=f"{broken}:compute_score"): "ModuleNotFoundError",
        RewardSpec(function=f"{reward_file}:missing"): "has no function 'missing'",
        RewardSpec(function=f"{tmp_path}/absent.py:fn"): "no such file",
        RewardSpec(function="no_such_package.mod:fn"): "importing no_such_package.mod failed",
        RewardSpec(function="nonsense"): "expected one of auto",
    }
    for spec, expected in cases.items():
        with pytest.raises(RewardFunctionError) as caught:
            load_function(spec)
        assert expected in str(caught.value) and spec.label.split(":")[0] in str(caught.value)


def test_normalize_rejects_what_is_not_a_score() -> None:
    assert normalize(True).score == 1.0
    for bad, message in (({"acc": 1}, "no 'score'"), ("1", "expected a number"), (float("nan"), "not a finite")):
        with pytest.raises((TypeError, ValueError), match=message):
            normalize(bad)


def test_sandbox_contains_raise_hang_and_exit(reward_file: Path) -> None:
    scorer = SandboxedScorer(RewardSpec(function=f"{reward_file}:flaky", timeout_s=1.0))
    try:
        assert scorer.score(_request("fine")).score == 1.0
        raised = scorer.score(_request("raise"))
        assert raised.score == 0.0 and raised.error == "RuntimeError: the verifier broke"
        started = time.monotonic()
        hung = scorer.score(_request("hang"))
        assert hung.error is not None and "timed out after 1 s" in hung.error
        assert time.monotonic() - started < 5
        assert scorer.score(_request("fine")).score == 1.0  # a fresh sandbox serves the next sample
        died = scorer.score(_request("exit"))
        assert died.error is not None and "died (exit code 3)" in died.error
        assert scorer.score(_request("fine")).error is None
    finally:
        scorer.close()


def test_sandbox_refuses_a_function_that_does_not_load(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit('no')\n")
    scorer = SandboxedScorer(RewardSpec(function=f"{broken}:fn"))
    with pytest.raises(RewardFunctionError, match="SystemExit"):
        scorer.score(_request("x"))
    loaded_here = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
    assert str(broken) not in loaded_here  # loading ran in the child, not here
