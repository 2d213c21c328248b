"""GPU-check parts for the torch workload: a ``TorchEngine`` rollout and a ``Trainer`` step on the GPU.

What it proves: the reference workload's engine and trainer run on CUDA (not only the CPU the
test suite uses), with figures: rollout tokens/s on the engine's default decode path (EOS
disabled so every row decodes ``max_new_tokens``, the same work as the vLLM bench) and seconds
per GRPO optimizer step. ``decode_part`` holds the decode paths against their goals.
Two model sizes, random-init Qwen3 made in memory: the quickstart's ``tiny`` and the 14 M
``small``, where the GPU is not idle.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from rlctl.gpucheck.fixtures import make_requests, synthetic_samples
from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip

ROLLOUT_BATCH = 64
ROLLOUT_NEW_TOKENS = 64
TRAIN_STEPS = 3
MODEL_SIZES = {"default": "tiny", "large": "small"}  # rlctl.workload.hf_init sizes


def require_cuda() -> Any:
    """The torch module when CUDA works here; ``Skip`` otherwise."""
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return torch


def model(size: str, seed: int = 0) -> Any:
    """A random-init Qwen3 ``HFPolicy`` of ``size`` (float32), made in memory."""
    from rlctl.workload.hf_init import random_policy

    return random_policy("qwen3", size, seed)


def rollout_tokens_per_s(torch: Any, size: str, device: str) -> dict[str, Any]:
    """Tokens/s of one warm ``generate`` of ``ROLLOUT_BATCH`` x ``ROLLOUT_NEW_TOKENS`` on ``device``."""
    from rlctl.workload.engine import SamplingConfig, TorchEngine

    engine = TorchEngine(model(size), SamplingConfig(temperature=1.0, eos_id=-1), device=device)
    requests = make_requests(ROLLOUT_BATCH)
    engine.generate(requests, ROLLOUT_NEW_TOKENS)  # warm-up: kernels, allocator, the CUDA graph of this batch
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = engine.generate(requests, ROLLOUT_NEW_TOKENS)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_tokens) for r in results)
    if tokens != ROLLOUT_BATCH * ROLLOUT_NEW_TOKENS:
        raise CheckFailed(f"expected {ROLLOUT_BATCH * ROLLOUT_NEW_TOKENS} tokens, got {tokens}")
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
            "decode_path": engine.last_stats.decode_path}


def rollout() -> Figures:
    """GPU tokens/s per model shape, with the CPU figure for the default shape as the baseline."""
    torch = require_cuda()
    figures: Figures = {"batch": ROLLOUT_BATCH, "max_new_tokens": ROLLOUT_NEW_TOKENS}
    for name, size in MODEL_SIZES.items():
        figures[f"cuda_{name}"] = rollout_tokens_per_s(torch, size, "cuda")
    figures["cpu_default"] = rollout_tokens_per_s(torch, MODEL_SIZES["default"], "cpu")
    figures["speedup_default"] = round(figures["cuda_default"]["tokens_per_s"] / figures["cpu_default"]["tokens_per_s"], 2)
    return figures


def train_step_seconds(torch: Any, size: str) -> dict[str, Any]:
    """Median seconds of ``TRAIN_STEPS`` GRPO steps on CUDA after one warm-up step; checks they train."""
    from rlctl.workload.trainer import Trainer

    trainer = Trainer(model(size), device="cuda", distributed=False)
    samples = synthetic_samples(seed=1)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step(samples)
    times, losses = [], []
    for _ in range(TRAIN_STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = trainer.train_step(samples)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(metrics["loss"])
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    if not changed or not all(math.isfinite(x) for x in losses) or trainer.step != TRAIN_STEPS + 1:
        raise CheckFailed(f"trainer did not train: changed={changed} losses={losses} step={trainer.step}")
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"params": params, "samples": len(samples), "step_s_median": round(statistics.median(times), 4),
            "losses": [round(x, 5) for x in losses],
            "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def train_step() -> Figures:
    """One GRPO trainer step on the GPU per model shape."""
    torch = require_cuda()
    return {name: train_step_seconds(torch, size) for name, size in MODEL_SIZES.items()}
