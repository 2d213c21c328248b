"""The built-in code reward: correct programs pass, wrong ones fail, and a program that loops,
allocates without bound, forks or crashes gets a score within its limits, never a hung verifier."""

from __future__ import annotations

import json
import time

import pytest

from rlctl.workload.code_verifier import compute_score
from rlctl.workload.rewardfn import RewardSpec, load_function

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
ECHO_CASES = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6", "20"]})
LIMITS = {"timeout_s": 1.0, "memory_mb": 256}


def fenced(code: str) -> str:
    return f"Here is my answer.\n```python\n{code}\n```\nDone."


@pytest.mark.parametrize(("response", "truth", "score", "outcome"), [
    (fenced("def add(a, b):\n    return a + b"), ADD_TESTS, 1.0, "passed"),
    (fenced("def add(a, b):\n    return a - b"), ADD_TESTS, 0.0, "failed"),
    (fenced("def add(a, b) return"), ADD_TESTS, 0.0, "error"),
    ("print(int(input()) * 2)", ECHO_CASES, 1.0, "passed"),
    (fenced("n = int(input())\nprint(n * 2 if n < 5 else 0)"), ECHO_CASES, 0.5, "failed"),
    (fenced("while True:\n    pass"), ADD_TESTS, 0.0, "timeout"),
    (fenced("import time\ntime.sleep(60)"), ECHO_CASES, 0.0, "timeout"),
    (fenced("x = bytearray(10 ** 10)"), ADD_TESTS, 0.0, "memory"),
    (fenced("import os\nos.kill(os.getpid(), 9)"), ADD_TESTS, 0.0, "error"),
])
def test_each_program_gets_a_score_within_its_limits(response: str, truth: str, score: float, outcome: str) -> None:
    began = time.monotonic()
    result = compute_score("code", response, truth, LIMITS)
    assert (result["score"], result["outcome"]) == (score, outcome), result
    assert result["acc"] == (score == 1.0)
    assert time.monotonic() - began < 5.0, "the verifier waited past its limits"


def test_a_program_that_forks_a_sleeper_does_not_outlive_its_limit() -> None:
    began = time.monotonic()
    result = compute_score("code", fenced("import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)"),
                           ADD_TESTS, LIMITS)
    assert result["outcome"] == "timeout" and time.monotonic() - began < 5.0


def test_it_is_a_builtin_reward_function() -> None:
    function = load_function(RewardSpec.from_table({"function": "code", "path": "", "name": "compute_score",
                                                    "timeout_s": 5.0, "on_error": "zero"}))
    assert function("code", fenced("def add(a, b):\n    return a + b"), ADD_TESTS, LIMITS)["score"] == 1.0
