"""Measuring an engine's curve for elastic rollout parallelism (``rlctl model curve``).

For each tensor-parallel degree the engine is rebuilt at that degree (``resize``, as a regrouping
rollout does) and decodes batches of several sizes; each point is the mean seconds of a decode
step. The regroup time is measured the way the rollout pays it: rebuild at another degree, then
load the weights it holds. ``rlctl.core.elastic.fit_curve`` fits the points; the job file names
the result as ``[rollout.elastic] curve``. The torch engine's degree on CPU is its intra-op
threads; on a GPU tensor parallelism needs the vLLM engine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from rlctl.workload.engine import GenRequest

PROMPT_TOKENS = 8


def decode_step_s(engine: Any, batch: int, tokens: int, vocab: int, seed: int = 0) -> float:
    """Mean seconds of one decode step with ``batch`` sequences of ``tokens`` new tokens (no stop:
    every sequence runs to the cap, prefill amortised over the run)."""
    requests = [GenRequest(f"c{index}", [(seed + 7 * index + t) % max(vocab - 1, 1) + 1 for t in range(PROMPT_TOKENS)],
                           seed + index) for index in range(batch)]
    started = time.perf_counter()
    engine.generate(requests, tokens, chunk_tokens=tokens)
    return (time.perf_counter() - started) / tokens


def regroup_s(engine: Any, state: dict[str, Any], degree: int, devices: str) -> float:
    """Seconds to rebuild ``engine`` at ``degree`` and load the held ``state``, as a regrouping rollout does."""
    started = time.perf_counter()
    engine.resize(degree, devices)
    engine.load_state_dict(state, engine.version)
    return time.perf_counter() - started


def measure_curve(engine: Any, state: dict[str, Any], degrees: list[int], batches: list[int], tokens: int,
                  vocab: int, repeats: int = 3, devices: Callable[[int], str] = lambda degree: "",
                  on_point: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Points for every degree and batch (median of ``repeats``), and the median regroup seconds
    (rebuild at the next degree plus loading ``state``, the held weights)."""
    points: list[dict[str, Any]] = []
    regroups: list[float] = []
    for degree in degrees:
        regroups.append(regroup_s(engine, state, degree, devices(degree)))
        decode_step_s(engine, 1, 4, vocab)  # warm up at this degree
        for batch in batches:
            seconds = statistics.median(decode_step_s(engine, batch, tokens, vocab, seed=r) for r in range(repeats))
            point = {"tensor_parallel": degree, "batch": batch, "step_s": round(seconds, 7)}
            points.append(point)
            if on_point is not None:
                on_point(point)
    for degree in degrees * max(1, repeats - 1):  # more rebuilds for the regroup's median
        regroups.append(regroup_s(engine, state, degree, devices(degree)))
    return {"points": points, "regroup_s": round(statistics.median(regroups), 6), "regroups_s": [round(r, 6) for r in regroups],
            "tokens": tokens}
