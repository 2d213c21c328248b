"""GPU-check parts for NVML: the agent's ``NvmlProvider`` against the real driver, and its cost.

What it proves: the provider the agent ships (``rlctl_agent.gpu``) initialises on a real driver,
enumerates the GPUs, reads samples whose values are physically plausible, and that its event
wait (``nvmlEventSetWait_v2``) returns on its timeout without raising: the agent's event thread
relies on that. ``sample_cost`` measures one ``sample()`` call, the price of every heartbeat.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip

EVENT_WAIT_MS = 500
COST_WARMUP = 10
COST_SAMPLES = 200


def open_provider() -> Any:
    """The real ``NvmlProvider``; ``Skip`` when NVML or the agent package is unusable here."""
    try:
        from rlctl_agent.gpu import NoGpuError, NvmlProvider
    except ImportError as exc:
        raise Skip(f"rlctl_agent not importable ({exc})") from None
    try:
        return NvmlProvider.open()
    except NoGpuError as exc:
        raise Skip(str(exc)) from None


def sample_problems(sample: dict[str, Any]) -> list[str]:
    """Out-of-range values in one GPU sample (None is allowed: the GPU does not support that query)."""
    index = sample.get("index")
    ranges = {"util": (0, 100), "temp_c": (0, 120), "power_w": (0, 2000), "ecc_sbe": (0, 10**12), "ecc_dbe": (0, 10**12)}
    problems = [f"gpu {index}: {key}={sample[key]} outside {low}..{high}"
                for key, (low, high) in ranges.items()
                if sample.get(key) is not None and not low <= sample[key] <= high]
    if sample.get("lost"):
        problems.append(f"gpu {index}: reported lost")
    used, total = sample.get("mem_used"), sample.get("mem_total")
    if total is None or total <= 0 or used is None or not 0 <= used <= total:
        problems.append(f"gpu {index}: memory {used}/{total} not sane")
    return problems


def facts_problems(facts: dict[str, Any]) -> list[str]:
    gpus = facts.get("gpus", [])
    problems = [] if gpus else ["no GPUs enumerated"]
    for gpu in gpus:
        if not str(gpu.get("uuid", "")).startswith(("GPU-", "MIG-")) or not gpu.get("name") or gpu.get("memory_total", 0) <= 0:
            problems.append(f"gpu facts not sane: {gpu}")
    return problems


def check_provider() -> Figures:
    """Facts, one sample per GPU, and one event wait that must time out cleanly."""
    provider = open_provider()
    try:
        facts = provider.facts()
        samples = provider.sample()
        started = time.perf_counter()
        signals = provider.poll_events(EVENT_WAIT_MS)
        waited_s = time.perf_counter() - started
    finally:
        provider.close()
    problems = facts_problems(facts) + [p for s in samples for p in sample_problems(s)]
    if not 0.8 * EVENT_WAIT_MS / 1000 <= waited_s <= EVENT_WAIT_MS / 1000 + 2.0 and not signals:
        problems.append(f"event wait of {EVENT_WAIT_MS} ms returned after {waited_s:.3f} s")
    figures = {"gpus": facts["gpus"], "samples": samples, "event_wait_ms": EVENT_WAIT_MS,
               "event_wait_returned_s": round(waited_s, 3), "event_signals": signals}
    if problems:
        raise CheckFailed("; ".join(problems) + f" | {figures}")
    return figures


def sample_cost() -> Figures:
    """Median and p95 milliseconds per ``sample()`` over all GPUs of the node."""
    provider = open_provider()
    try:
        gpu_count = len(provider.facts()["gpus"])
        for _ in range(COST_WARMUP):
            provider.sample()
        times_ms = []
        for _ in range(COST_SAMPLES):
            started = time.perf_counter()
            provider.sample()
            times_ms.append((time.perf_counter() - started) * 1000)
    finally:
        provider.close()
    times_ms.sort()
    median = statistics.median(times_ms)
    return {"gpus": gpu_count, "samples": COST_SAMPLES, "ms_per_sample_median": round(median, 3),
            "ms_per_sample_p95": round(times_ms[int(0.95 * len(times_ms)) - 1], 3),
            "ms_per_gpu_median": round(median / max(gpu_count, 1), 3)}
