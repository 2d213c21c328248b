"""The built-in code reward (``[reward] function = "code"``): run the response's Python program
against the sample's tests in a child process with a time and a memory limit.

The program is the response's last fenced ```python block (or the whole response when it has
none). The ground truth is either

- test code: statements run after the program (``assert add(1, 2) == 3``), or
- stdin/stdout cases: JSON ``{"inputs": [...], "outputs": [...]}``, each input fed to the program
  on stdin and its stdout compared with the output (surrounding whitespace ignored).

The score is the fraction of cases passed (test code is one case), ``acc`` whether all passed.
Limits per run: ``extra_info["timeout_s"]`` (default 2 s of wall time, and as much CPU time) and
``extra_info["memory_mb"]`` (default 512 MiB of address space). A program that loops, allocates
without bound, crashes or prints garbage gets a score and an ``outcome`` (``passed``, ``failed``,
``error``, ``timeout``, ``memory``); the verifier never hangs and never takes its worker down with
it. The child is ``python -I`` (no user site, no environment), in a fresh temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 512
MAX_OUTPUT_BYTES = 1 << 20
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class RunResult:
    outcome: str  # passed | failed | error | timeout | memory
    stdout: str = ""


def extract_program(solution_str: str) -> str:
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def run_program(source: str, stdin: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                memory_mb: int = DEFAULT_MEMORY_MB) -> RunResult:
    """Run ``source`` in ``python -I`` under the limits; the process group is killed on timeout."""
    memory = int(memory_mb) * 1024 * 1024
    cpu = max(1, int(timeout_s + 0.999))

    def limit() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))

    with tempfile.TemporaryDirectory(prefix="rlctl-code-") as workdir:
        process = subprocess.Popen([sys.executable, "-I", "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, cwd=workdir, env={"PATH": "/usr/bin:/bin"},
                                   preexec_fn=limit)  # noqa: PLW1509 - the limits must be set in the child
        try:
            out, err = process.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            return RunResult("timeout")
    if process.returncode == 0:
        return RunResult("passed", out[:MAX_OUTPUT_BYTES].decode(errors="replace"))
    if b"MemoryError" in err[-2000:]:
        return RunResult("memory")
    if process.returncode == -signal.SIGXCPU:
        return RunResult("timeout")  # its CPU time ran out before the wall clock did
    return RunResult("error" if b"AssertionError" not in err[-2000:] else "failed")


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    """verl's signature. See the module docstring for the ground truth's two forms."""
    info = extra_info if isinstance(extra_info, dict) else {}
    timeout_s = float(info.get("timeout_s", DEFAULT_TIMEOUT_S))
    memory_mb = int(info.get("memory_mb", DEFAULT_MEMORY_MB))
    program = extract_program(solution_str)
    cases = _io_cases(ground_truth)
    if cases is None:
        result = run_program(f"{program}\n\n{ground_truth}\n", timeout_s=timeout_s, memory_mb=memory_mb)
        ok = result.outcome == "passed"
        return {"score": 1.0 if ok else 0.0, "acc": ok, "outcome": result.outcome}
    outcomes = []
    for stdin, expected in cases:
        result = run_program(program, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.outcome == "passed" and result.stdout.strip() != expected.strip():
            result = RunResult("failed", result.stdout)
        outcomes.append(result.outcome)
        if result.outcome in ("timeout", "memory"):
            break  # the rest would cost as much: they count as failed
    passed = sum(1 for o in outcomes if o == "passed")
    worst = next((o for o in ("timeout", "memory", "error", "failed") if o in outcomes), "passed")
    return {"score": passed / len(cases), "acc": passed == len(cases), "outcome": worst}


def _io_cases(ground_truth: Any) -> list[tuple[str, str]] | None:
    data = ground_truth
    if isinstance(ground_truth, str):
        try:
            data = json.loads(ground_truth)
        except ValueError:
            return None
    if isinstance(data, dict) and isinstance(data.get("inputs"), list) and isinstance(data.get("outputs"), list):
        if len(data["inputs"]) != len(data["outputs"]) or not data["inputs"]:
            raise ValueError("code ground truth: expected as many inputs as outputs, at least one")
        return [(str(i), str(o)) for i, o in zip(data["inputs"], data["outputs"])]
    return None
