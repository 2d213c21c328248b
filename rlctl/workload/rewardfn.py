"""Reward functions: the user's (verl's signature), the built-in ones, and a sandbox that contains them.

Role: the ``[reward]`` table of job.toml. A reward function has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`` (a dict carries
``score`` plus extra metrics; ``async def`` works too). It is named as

- ``function = "package.module:fn"`` or ``function = "path/to/file.py:fn"``;
- verl's own form, ``path = "file.py"`` with ``name`` (default ``compute_score``);
- a built-in: ``gsm8k`` (the answer after ``####``; ``gsm8k-flexible`` takes the last number),
  ``math`` (``math-verify``), ``task`` (the reference task's scorer), ``code`` (the response's
  Python program run against the sample's tests with a time and memory limit) or ``auto`` (by
  ``data_source``, as verl's default does).

``load_function`` imports it (``RewardFunctionError`` names the function and the cause: the
launch checks this before any node starts). ``SandboxedScorer`` runs it in a child process with a
per-sample time limit: a function that raises, hangs or kills its process gives a
``ScoreOutcome`` with ``error`` set, never a hung or dead reward worker.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.workload.sandbox import ChildSandbox, child_loop, import_location

BUILTINS = ("auto", "gsm8k", "gsm8k-flexible", "math", "task", "code")
ON_ERROR = ("zero", "fail")
DEFAULT_NAME = "compute_score"
GSM8K_TAIL_CHARS = 300  # the final answer is looked for near the end: a long ramble cannot hide one


class RewardFunctionError(ValueError):
    """The reward function cannot be found or imported; the message names it."""


@dataclass(frozen=True)
class RewardSpec:
    """Which function scores samples and what happens when it fails."""

    function: str = "auto"
    path: str = ""
    name: str = DEFAULT_NAME
    timeout_s: float = 10.0
    on_error: str = "zero"

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> RewardSpec:
        return cls(function=str(table.get("function", cls.function)), path=str(table.get("path", "")),
                   name=str(table.get("name", DEFAULT_NAME)), timeout_s=float(table.get("timeout_s", cls.timeout_s)),
                   on_error=str(table.get("on_error", cls.on_error)))

    @property
    def builtin(self) -> str | None:
        """The built-in function's name when this spec names one (``call_function`` needs it)."""
        return self.function if not self.path and self.function in _BUILTIN_FUNCTIONS else None

    @property
    def label(self) -> str:
        """How messages and events name the function."""
        if self.path:
            return f"{self.path}:{self.name}"
        return self.function

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "path": self.path, "name": self.name, "timeout_s": self.timeout_s,
                "on_error": self.on_error}


# ------------------------------------------------------------------------------------ built-ins

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def gsm8k_extract(solution_str: str, flexible: bool = False) -> str | None:
    """The final answer: strict takes the number after ``#### ``; flexible the last number anywhere."""
    tail = solution_str[-GSM8K_TAIL_CHARS:]
    if not flexible:
        found = _GSM8K_STRICT.findall(tail)
        return _clean_number(found[-1]) if found else None
    numbers = [n for n in _NUMBER.findall(tail) if n not in ("", ".")]
    return _clean_number(numbers[-1]) if numbers else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                flexible: bool = False) -> dict[str, Any]:
    answer = gsm8k_extract(solution_str, flexible)
    correct = answer is not None and answer == _clean_number(str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "formatted": answer is not None}


def gsm8k_flexible_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    return gsm8k_score(data_source, solution_str, ground_truth, extra_info, flexible=True)


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    """``math-verify``: the ground truth (wrapped in ``$...$`` when it has none) against the solution."""
    from math_verify import parse, verify

    truth = str(ground_truth)
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"${truth}$"
    correct = bool(verify(parse(truth), parse(solution_str)))
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def task_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
               truncated: bool = False) -> dict[str, Any]:
    """The reference task's scorer on decoded text: exact answer and a finished response, else
    partial credit for the characters in place."""
    from rlctl.workload.task import score_text

    reward, correct = score_text(str(ground_truth), solution_str.strip(), not truncated)
    return {"score": reward, "acc": correct}


def auto_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
               truncated: bool = False) -> dict[str, Any]:
    """verl's default dispatch: the scorer is chosen by the sample's ``data_source``."""
    source = data_source.lower()
    if "gsm8k" in source:
        return gsm8k_score(data_source, solution_str, ground_truth, extra_info)
    if "math" in source:
        return math_score(data_source, solution_str, ground_truth, extra_info)
    if source.startswith("rlctl/task"):
        return task_score(data_source, solution_str, ground_truth, extra_info, truncated)
    raise ValueError(f"no built-in scorer for data_source {data_source!r} (known: *gsm8k*, *math*, rlctl/task*); "
                     "name a function in [reward] function")


def code_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    """The response's Python program against the sample's tests, in a limited child process
    (``rlctl.workload.code_verifier``)."""
    from rlctl.workload.code_verifier import compute_score

    return compute_score(data_source, solution_str, ground_truth, extra_info)


_BUILTIN_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "auto": auto_score, "gsm8k": gsm8k_score, "gsm8k-flexible": gsm8k_flexible_score, "math": math_score,
    "task": task_score, "code": code_score,
}
# Built-ins that also want to know whether the response was cut at the length cap.
_WANTS_TRUNCATED = {"auto", "task"}


# ------------------------------------------------------------------------------------- loading

def load_function(spec: RewardSpec, base_dir: Path | None = None) -> Callable[..., Any]:
    """The callable ``spec`` names; relative file paths are read from ``base_dir`` (the job file's folder)."""
    if not spec.path and spec.function in _BUILTIN_FUNCTIONS:
        return _BUILTIN_FUNCTIONS[spec.function]
    if spec.path:
        location, attr = spec.path, spec.name
    else:
        location, sep, attr = spec.function.rpartition(":")
        if not sep or not location or not attr:
            raise RewardFunctionError(
                f"[reward] function {spec.function!r}: expected one of {', '.join(BUILTINS)}, "
                "'package.module:function' or 'path/to/file.py:function'")
    try:
        module = import_location(location, base_dir)
    except FileNotFoundError as exc:
        raise RewardFunctionError(f"[reward] {spec.label}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - user code may raise anything, SystemExit included, at import
        raise RewardFunctionError(f"[reward] {spec.label}: importing {location} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise RewardFunctionError(f"[reward] {spec.label}: {location} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------- scoring

@dataclass(frozen=True)
class ScoreRequest:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any]
    truncated: bool = False


@dataclass(frozen=True)
class ScoreOutcome:
    """A sample's score; ``error`` set means the function failed and ``score`` is 0."""

    score: float
    correct: bool
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def normalize(result: Any) -> ScoreOutcome:
    """A function's return value as a score: a number, or a dict with ``score`` (plus numeric extras;
    ``acc`` or ``correct`` says whether it was right, else a score of at least 1 does)."""
    extras: dict[str, float] = {}
    correct_flag: Any = None
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"the returned dict has no 'score' key (keys: {', '.join(map(str, result))})")
        for key, value in result.items():
            if key != "score" and isinstance(value, (int, float)) and math.isfinite(float(value)):
                extras[str(key)] = float(value)
        correct_flag = result.get("acc", result.get("correct"))
        result = result["score"]
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        if isinstance(result, bool):
            result = float(result)
        else:
            raise TypeError(f"expected a number or a dict with 'score', got {type(result).__name__}")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"the score is not a finite number ({value})")
    correct = bool(correct_flag) if correct_flag is not None else value >= 1.0
    return ScoreOutcome(value, correct, extras)


def call_function(function: Callable[..., Any], request: ScoreRequest, builtin: str | None) -> ScoreOutcome:
    """Call once (an ``async def`` is run to completion) and normalise; exceptions propagate."""
    kwargs = {"truncated": request.truncated} if builtin in _WANTS_TRUNCATED else {}
    result = function(request.data_source, request.solution_str, request.ground_truth, request.extra_info, **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return normalize(result)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _child_main(conn: Any, spec_data: dict[str, Any], base_dir: str | None) -> None:
    """The sandbox process: load the function once, then score one request per message."""
    spec = RewardSpec(**spec_data)

    def load() -> Callable[[ScoreRequest], ScoreOutcome]:
        function = load_function(spec, Path(base_dir) if base_dir else None)
        return lambda request: call_function(function, request, spec.builtin)

    child_loop(conn, load, RewardFunctionError)


class SandboxedScorer:
    """Scores samples with ``spec``'s function in a child process (``ChildSandbox``), one at a time.

    Blocking. ``score`` always returns: an exception in the function, a call past ``timeout_s``
    (the child is killed and a fresh one started for the next sample) or a dead child each give
    an outcome with ``error`` set. ``RewardFunctionError`` is raised only when the function
    cannot be loaded at all.
    """

    def __init__(self, spec: RewardSpec, base_dir: Path | None = None) -> None:
        self.spec = spec
        self.sandbox = ChildSandbox(_child_main, (spec.to_dict(), str(base_dir) if base_dir else None),
                                    "the reward function", f"[reward] {spec.label}", RewardFunctionError)

    def score(self, request: ScoreRequest) -> ScoreOutcome:
        kind, detail = self.sandbox.call(request, self.spec.timeout_s)
        return detail if kind == "ok" else ScoreOutcome(0.0, False, error=str(detail))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.sandbox.close()
