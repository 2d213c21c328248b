"""GPU-check part ``torch_decode``: ``TorchEngine``'s fast CUDA decode path against its goals.

What it proves (issue 31, item 4): the static-cache decode path captured as CUDA graphs
(``rlctl.workload.engine_static``, the CUDA default) makes a decode step of the default model cost
at most ``DECODE_STEP_GOAL_MS`` at every batch size from 1 to 128, and rollout tokens/s at least
``SPEEDUP_GOAL`` times the CPU's at both ``torch_rollout`` shapes; and that it samples what the
eager path samples (float32 model, same seeds: ``AGREEMENT_GOAL`` of the rows identical, the
rest can differ only by rounding). The eager path is measured in the same run for comparison. A
figure short of its goal fails the part, with every figure in the report.

The CPU twin (``CPU_TWIN``, run by ``tests/gpu/test_gpucheck.py``) runs the same code on CPU, the
static path without graphs, with the goals reported but not asserted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlctl.gpucheck.fixtures import make_requests
from rlctl.gpucheck.outcome import CheckFailed, Figures
from rlctl.gpucheck.torch_parts import MODEL_SIZES, ROLLOUT_BATCH, ROLLOUT_NEW_TOKENS, model, require_cuda

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_STEP_GOAL_MS = 1.0  # per step of the default model, at every batch size (H100/H200)
SPEEDUP_GOAL = 3.0  # CUDA tokens/s over the CPU's, at each torch_rollout shape
AGREEMENT_GOAL = 0.9  # rows the fast and eager paths sample identically (float32)


@dataclass(frozen=True)
class DecodeBench:
    """What ``decode_figures`` measures: the ``fast`` decode path on ``device`` against the eager
    path there and on the CPU."""

    device: str
    fast: str  # a TorchEngine decode path: "graph" on CUDA
    batches: tuple[int, ...] = DECODE_BATCHES
    rollout_batch: int = ROLLOUT_BATCH
    new_tokens: int = ROLLOUT_NEW_TOKENS
    sizes: dict[str, str] = field(default_factory=lambda: dict(MODEL_SIZES))


GPU_BENCH = DecodeBench("cuda", "graph")
CPU_TWIN = DecodeBench("cpu", "static", batches=(1, 4), rollout_batch=4, new_tokens=8)


def _timed(torch: Any, device: str, call: Any) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _engine(size: str, device: str, decode: str) -> Any:
    from rlctl.workload.engine import SamplingConfig, TorchEngine

    return TorchEngine(model(size), SamplingConfig(temperature=1.0, eos_id=-1), device=device, decode=decode)


def decode_ms_per_step(torch: Any, engine: Any, batches: tuple[int, ...],
                       new_tokens: int) -> tuple[dict[str, float], dict[str, str]]:
    """Milliseconds per decode step of a whole ``generate`` (prefill included, as the tail bench's
    probe measures), rows never stopping, best of 3 after a first call (kernels, graph capture);
    and the path each batch decoded on (``static: <capture error>`` where a graph capture failed)."""
    from rlctl.workload.engine import GenRequest

    prompt = make_requests(1)[0].prompt_tokens
    costs: dict[str, float] = {}
    paths: dict[str, str] = {}
    for batch in batches:
        requests = [GenRequest(f"probe-{i}", prompt, i) for i in range(batch)]
        def call(requests: list[Any] = requests) -> None:
            engine.generate(requests, new_tokens)

        call()
        best = min(_timed(torch, engine.device.type, call) for _ in range(3))
        costs[str(batch)] = round(best / new_tokens * 1000, 4)
        paths[str(batch)] = _path_of(engine.last_stats)
    return costs, paths


def _path_of(stats: Any) -> str:
    """The decode path of the engine's last call, with the capture error where there was one."""
    return f"{stats.decode_path}: {stats.capture_error}" if stats.capture_error else str(stats.decode_path)


def rollout_rate(torch: Any, size: str, device: str, decode: str, batch: int, new_tokens: int) -> dict[str, Any]:
    """Tokens/s of a warm ``generate`` of ``batch`` x ``new_tokens`` (and the first call's seconds)."""
    engine = _engine(size, device, decode)
    requests = make_requests(batch)
    first_s = _timed(torch, device, lambda: engine.generate(requests, new_tokens))
    seconds = _timed(torch, device, lambda: engine.generate(requests, new_tokens))
    tokens = engine.last_stats.generated_tokens
    if tokens != batch * new_tokens:
        raise CheckFailed(f"{size} on {device} ({decode}): expected {batch * new_tokens} tokens, got {tokens}")
    return {"tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 4), "first_call_s": round(first_s, 4),
            "decode_path": _path_of(engine.last_stats)}


def path_agreement(bench: DecodeBench) -> dict[str, Any]:
    """The share of rows the fast and eager paths sample identically: the default model in
    float32, the same seeds, EOS on so rows end at scattered steps."""
    from rlctl.workload.engine import SamplingConfig, TorchEngine

    policy = model(bench.sizes["default"])
    requests = make_requests(bench.rollout_batch, seed=1)
    fast = TorchEngine(policy, SamplingConfig(), device=bench.device, decode=bench.fast).generate(requests, bench.new_tokens)
    eager = TorchEngine(policy, SamplingConfig(), device=bench.device, decode="eager").generate(requests, bench.new_tokens)
    same = sum(a == b for a, b in zip(fast, eager, strict=True))
    return {"rows": len(eager), "identical_rows": round(same / len(eager), 4),
            "mean_length": round(sum(len(r.response_tokens) for r in eager) / len(eager), 2)}


def decode_figures(torch: Any, bench: DecodeBench) -> Figures:
    """Every figure of the part, the goals and the ones missed (not asserted here)."""
    figures: Figures = {"device": bench.device, "fast_path": bench.fast, "new_tokens": bench.new_tokens,
                        "rollout_batch": bench.rollout_batch}
    steps = {path: decode_ms_per_step(torch, _engine(bench.sizes["default"], bench.device, path), bench.batches,
                                      bench.new_tokens)
             for path in (bench.fast, "eager")}
    figures["decode_ms_per_step"] = {path: costs for path, (costs, _) in steps.items()}
    figures["decode_path_by_batch"] = {path: paths for path, (_, paths) in steps.items()}
    rates: dict[str, Any] = {}
    for shape, size in bench.sizes.items():
        shape_rates = {"cpu": rollout_rate(torch, size, "cpu", "eager", bench.rollout_batch, bench.new_tokens)}
        for path in (bench.fast, "eager"):
            shape_rates[path] = rollout_rate(torch, size, bench.device, path, bench.rollout_batch, bench.new_tokens)
        fast_rate = shape_rates[bench.fast]["tokens_per_s"]
        shape_rates["speedup_vs_cpu"] = round(fast_rate / shape_rates["cpu"]["tokens_per_s"], 2)
        shape_rates["speedup_vs_eager"] = round(fast_rate / shape_rates["eager"]["tokens_per_s"], 2)
        rates[shape] = shape_rates
    figures["tokens_per_s"] = rates
    figures["agreement"] = path_agreement(bench)
    figures["goals"] = {"decode_step_ms_max": DECODE_STEP_GOAL_MS, "speedup_vs_cpu_min": SPEEDUP_GOAL,
                        "identical_rows_min": AGREEMENT_GOAL}
    figures["missed_goals"] = missed_goals(figures)
    return figures


def missed_goals(figures: Figures) -> list[str]:
    """Each goal of ``figures`` the fast path falls short of, in words."""
    fast = figures["fast_path"]
    missed = [f"decode at batch {batch} ran on the {path} path, not {fast}"
              for batch, path in figures["decode_path_by_batch"][fast].items() if path != fast]
    missed += [f"decode step at batch {batch}: {ms} ms > {DECODE_STEP_GOAL_MS} ms"
               for batch, ms in figures["decode_ms_per_step"][fast].items() if ms > DECODE_STEP_GOAL_MS]
    missed += [f"{shape}: {rates['speedup_vs_cpu']}x the CPU's tokens/s < {SPEEDUP_GOAL}x"
               for shape, rates in figures["tokens_per_s"].items() if rates["speedup_vs_cpu"] < SPEEDUP_GOAL]
    identical = figures["agreement"]["identical_rows"]
    if identical < AGREEMENT_GOAL:
        missed.append(f"{fast} and eager paths sample {identical:.0%} of rows identically < {AGREEMENT_GOAL:.0%}")
    return missed


def assert_goals(figures: Figures) -> Figures:
    """``figures`` when every goal is met; ``CheckFailed`` (carrying them) otherwise."""
    missed = missed_goals(figures)
    if missed:
        raise CheckFailed("; ".join(missed), figures)
    return figures


def decode() -> Figures:
    """The part: the fast path's figures on the GPU, goals asserted."""
    return assert_goals(decode_figures(require_cuda(), GPU_BENCH))
