"""The built-in environment (``[env] class = "calculator"``): a calculator tool for GSM8K-layout math.

Role: the reference environment of the env role. The model may call the tool by writing
``<calc>EXPRESSION</calc>`` in its turn; the environment answers ``<result>VALUE</result>`` (or
``<result>error: ...</result>``) and the episode goes on. A turn without a tool call is the final
answer: the episode ends, and the job's reward function scores the whole response (the GSM8K
``#### N`` answer). The step reward is 0, so with ``[env] reward = "sum"`` the score is the reward
function's alone.

Expressions are evaluated by walking Python's AST: numbers, ``+ - * / // % **`` (small exponents)
and parentheses, nothing else, so a tool call cannot run code. Deterministic, so episodes replay.

``calculator_rows`` makes GSM8K-layout rows whose questions want the tool (products of two-digit
numbers), with a demonstration of the tool's use in ``extra_info.answer`` for a warm-start.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlctl.workload.gsm8k_layout import DATA_SOURCE, FINAL_ANSWER_MARK, instruction_for

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be computed."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``CalculatorError`` for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():  # a model's text can look like a bad literal ("3x"): a refusal, not a warning
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip().replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent above {MAX_EXPONENT}")
        try:
            return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculatorError(str(exc)) from None
    raise CalculatorError("only numbers, + - * / // % ** and parentheses")


def format_value(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(round(value, 6)) if isinstance(value, float) else str(value)


class CalculatorEnv:
    """One episode: answers each ``<calc>`` call; a turn without one ends the episode."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, sample: dict[str, Any]) -> str:
        self.calls = 0
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        found = CALL.findall(action)
        if not found:
            return "", 0.0, True, {"tool_calls": self.calls}
        self.calls += 1
        try:
            result = format_value(evaluate(found[-1]))
        except CalculatorError as exc:
            result = f"error: {exc}"
        return f"<result>{result}</result>", 0.0, False, {"tool_calls": self.calls}


def calculator_rows(count: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """GSM8K-layout rows asking for a product of two two-digit numbers; ``extra_info.answer`` is
    a demonstration as the turns' texts: ``[tool call, observation, final answer]``."""
    rng = random.Random(f"calculator/{seed}/{split}")
    rows = []
    for index in range(count):
        a, b = rng.randrange(11, 100), rng.randrange(11, 100)
        question = f"What is {a} * {b}?"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": instruction_for(question) + " Use <calc>expression</calc> to compute."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "question": question,
                           "turns": [f"<calc>{a} * {b}</calc>", f"<result>{a * b}</result>",
                                     f"{FINAL_ANSWER_MARK} {a * b}"]},
        })
    return rows


def warm_started_calculator_model(source: Path, target: Path, rows: int = 512, steps: int = 500, seed: int = 0) -> Path:
    """``target`` holding ``calc.jsonl`` (``calculator_rows`` whose ``extra_info.answer`` is the
    tool's demonstration rendered through ``source``'s chat template, as episodes show it) and
    ``model/``: ``source`` warm-started on those demonstrations (cached by recipe). Blocking."""
    from rlctl.workload.gsm8k_layout import write_rows
    from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
    from rlctl.workload.hf_warmstart import HFWarmStartConfig, prepare_warmstart
    from rlctl.workload.multiturn import ObservationFormat

    observations = ObservationFormat(ChatTokenizer(source), stop_token_ids(source)[0])
    demonstrations = calculator_rows(rows, seed)
    for row in demonstrations:
        row["extra_info"]["answer"] = observations.conversation(row["extra_info"]["turns"])
    data = write_rows(demonstrations, target / "calc.jsonl")
    prepare_warmstart(source, target / "model", data, seed,
                      HFWarmStartConfig(steps=steps, batch_size=32, lr=2e-3, warmup_steps=20))
    return target
