"""Environments: the user's class is loaded and checked with messages that name it; the sandbox
answers every call (an exception, a hang or a dead process is an error, never a stuck caller) and
rebuilds episodes by replay; the built-in calculator computes and refuses anything but arithmetic."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlctl.core.spec import EnvSpec
from rlctl.workload.calculator_env import CalculatorEnv, CalculatorError, calculator_rows, evaluate
from rlctl.workload.envs import EnvCall, EnvError, EnvHost, load_env_class

USER_ENV = textwrap.dedent('''
    import os, time

    class CountingEnv:
        """Counts its steps; misbehaves when told to."""
        def reset(self, sample):
            self.steps = 0
            return "start " + str(sample.get("ground_truth", ""))
        def step(self, action):
            if action == "raise":
                raise RuntimeError("the environment broke")
            if action == "hang":
                time.sleep(60)
            if action == "die":
                os._exit(3)
            self.steps += 1
            return f"step {self.steps}: {action}", 0.5, action == "stop", {"steps": self.steps, "pid": os.getpid()}

    class DiceEnv:
        """Answers at random: a replay cannot give back what the model was shown."""
        def reset(self, sample):
            return "roll"
        def step(self, action):
            return f"rolled {int.from_bytes(os.urandom(4), 'little')}", 0.0, False, {}

    class NoStep:
        def reset(self, sample):
            return ""
''')


@pytest.fixture()
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_env.py"
    path.write_text(USER_ENV)
    return path


def test_a_class_without_step_or_a_missing_file_is_an_error_naming_it(env_file: Path) -> None:
    with pytest.raises(EnvError, match=r"NoStep has no step method"):
        load_env_class(EnvSpec(class_ref=f"{env_file}:NoStep"))
    with pytest.raises(EnvError, match=r"no such file"):
        load_env_class(EnvSpec(class_ref=f"{env_file.parent}/missing.py:Env"))
    with pytest.raises(EnvError, match=r"has no class 'Nope'"):
        load_env_class(EnvSpec(class_ref=f"{env_file}:Nope"))
    with pytest.raises(EnvError, match=r"expected one of calculator"):
        load_env_class(EnvSpec(class_ref="calculator2"))
    assert load_env_class(EnvSpec()) is CalculatorEnv


def test_the_sandbox_answers_replays_and_survives_raise_hang_and_death(env_file: Path) -> None:
    host = EnvHost(EnvSpec(class_ref=f"{env_file}:CountingEnv", turn_timeout_s=1.0))
    sample = {"ground_truth": "7"}
    try:
        assert host.call(EnvCall("e1", sample, [])).observation == "start 7"
        first = host.call(EnvCall("e1", sample, ["a"]))
        assert (first.observation, first.reward, first.done, first.replayed) == ("step 1: a", 0.5, False, 0)
        assert host.call(EnvCall("e1", sample, ["a", "b"])).info["steps"] == 2
        # An episode this host never saw (started on another env worker) is rebuilt by replay.
        other = host.call(EnvCall("e2", sample, ["x", "y", "z"]))
        assert (other.observation, other.replayed) == ("step 3: z", 2)
        raised = host.call(EnvCall("e1", sample, ["a", "b", "raise"]))
        assert raised.error == "RuntimeError: the environment broke"
        hung = host.call(EnvCall("e1", sample, ["a", "b", "hang"]))
        assert hung.error == "timed out after 1 s"
        after = host.call(EnvCall("e1", sample, ["a", "b", "c"]))  # a fresh child: replayed
        assert (after.observation, after.replayed, after.error) == ("step 3: c", 2, None)
        died = host.call(EnvCall("e1", sample, ["a", "b", "c", "die"]))
        assert died.error is not None and "died (exit code 3)" in died.error
        assert host.call(EnvCall("e1", sample, ["a", "b", "c", "stop"])).done
        assert host.restarts == 2  # after the hang and after the death
    finally:
        host.close()


def test_a_replay_must_show_the_observations_the_model_was_shown(env_file: Path) -> None:
    """An episode rebuilt by replay (another env worker, a restarted child) is checked against what
    the model saw: a deterministic environment passes, a random one fails the call with a message
    that says why, so the trajectory never goes on from a state the model did not see."""
    sample = {"ground_truth": "7"}
    counting = EnvHost(EnvSpec(class_ref=f"{env_file}:CountingEnv"))
    dice, elsewhere = (EnvHost(EnvSpec(class_ref=f"{env_file}:DiceEnv")) for _ in range(2))
    try:
        seen = ["start 7", "step 1: a"]
        replayed = counting.call(EnvCall.from_request({"episode": "e", "sample": sample, "actions": ["a", "b"],
                                                       "observations": seen}))
        assert (replayed.observation, replayed.replayed, replayed.error) == ("step 2: b", 1, None)
        wrong = counting.call(EnvCall("f", sample, ["a", "b"], ["start 7", "step 1: not a"]))
        assert wrong.error is not None and "EnvReplayError" in wrong.error and "turn 1" in wrong.error
        shown = [dice.call(EnvCall("d", sample, [])).observation, dice.call(EnvCall("d", sample, ["go"])).observation]
        assert dice.call(EnvCall("d", sample, ["go", "again"], shown)).replayed == 0, "held: nothing replayed"
        moved = elsewhere.call(EnvCall("d", sample, ["go", "again"], shown))  # the episode on another worker
        assert moved.error is not None and "seed its randomness from the sample" in moved.error
        assert elsewhere.call(EnvCall("d", sample, ["go", "again"])).error is None, "no observations: not checked"
    finally:
        for host in (counting, dice, elsewhere):
            host.close()


def test_the_calculator_computes_arithmetic_only() -> None:
    assert evaluate("37 * 48") == 1776 and evaluate("(2 + 3) ** 2 - 1 / 4") == 24.75
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1 / 0", "[1, 2]", "9" * 300):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    env = CalculatorEnv()
    assert env.reset({}) == ""
    assert env.step("Let me compute <calc>12 * 12</calc>") == ("<result>144</result>", 0.0, False, {"tool_calls": 1})
    assert env.step("<calc>import os</calc>")[0].startswith("<result>error:")
    assert env.step("#### 144") == ("", 0.0, True, {"tool_calls": 2})


def test_calculator_rows_are_gsm8k_layout_with_a_tool_demonstration() -> None:
    rows = calculator_rows(3, seed=1)
    assert rows == calculator_rows(3, seed=1) and rows != calculator_rows(3, seed=2)
    row = rows[0]
    assert row["data_source"] == "openai/gsm8k" and row["prompt"][0]["role"] == "user"
    call, observation, answer = row["extra_info"]["turns"]
    expression = call.removeprefix("<calc>").removesuffix("</calc>")
    assert observation == f"<result>{evaluate(expression)}</result>"
    assert answer == f"#### {row['reward_model']['ground_truth']}"
