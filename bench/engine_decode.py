"""Per-step costs of the torch engine: its decode paths, its sampler and KV-cache compaction.

A whole decode step on each decode path (``TorchEngine(decode=...)``): milliseconds per step of a
``generate`` of the default model (prefill included, rows never stopping, best of 3 after a first
call), by batch size; on CUDA the ``graph`` path against ``eager``, on CPU ``static`` (the same
step without graphs) against ``eager`` (the CPU default). The GPU check's ``torch_decode`` part
runs the same measurement against its goals.

Two pieces of a decode step that grow with the number of live rows:

- sampling: ``rlctl.workload.engine.sample_rows`` (one counter-based uniform per row, inverse-CDF
  sampling in a few tensor operations) against the baseline of one seeded ``torch.Generator`` and
  one ``torch.multinomial`` call per row, which is what per-sample seeds usually cost;
- dropping finished rows: ``KVCache.select`` (copies only the filled prefix) against
  ``index_select`` of the whole preallocated buffer.

Best of 5 repetitions, microseconds per call, CPU, 2 intra-op threads (RLCTL_TORCH_THREADS).

    python bench/engine_decode.py [--rows 8 48 128] [--filled 20] [--max-len 170]
                                  [--device cpu|cuda] [--paths eager static] [--batches 1 8 32 128] [--new-tokens 32]

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.gpucheck.decode_part import decode_ms_per_step
from rlctl.gpucheck.torch_parts import MODEL_SIZES, model
from rlctl.workload.engine import SamplingConfig, TorchEngine, sample_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_gpt import KVCache, ModelConfig


def best_us(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - started) / repeats)
    return round(best * 1e6, 1)


def per_row_multinomial(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The baseline sampler: one generator and one multinomial call per row."""
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def measure_rows(rows: int, filled: int, max_len: int) -> dict[str, float]:
    """Both comparisons at ``rows`` live rows, ``filled`` of ``max_len`` cache positions used."""
    shape = ModelConfig()
    logits = torch.randn(rows, shape.vocab_size)
    seeds = torch.arange(rows, dtype=torch.int64)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    cache = KVCache(shape.n_layers, rows, shape.n_heads, max_len, shape.head_dim, torch.float32, torch.device("cpu"))
    cache.length = filled
    kept = torch.arange(rows - 1)
    sample_new = best_us(lambda: sample_rows(logits, seeds, 3, SamplingConfig()), 200)
    sample_base = best_us(lambda: per_row_multinomial(logits, generators), 200)
    select_new = best_us(lambda: (cache._select(cache.keys, kept), cache._select(cache.values, kept)), 50)
    select_base = best_us(lambda: (cache.keys.index_select(1, kept), cache.values.index_select(1, kept)), 50)
    return {
        "sample_us": sample_new, "sample_baseline_us": sample_base,
        "sample_speedup": round(sample_base / sample_new, 2),
        "drop_row_us": select_new, "drop_row_baseline_us": select_base,
        "drop_row_speedup": round(select_base / select_new, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 48, 128])
    parser.add_argument("--filled", type=int, default=20, help="cache positions filled when rows are dropped")
    parser.add_argument("--max-len", type=int, default=170, help="the cache's preallocated length (prompt + cap)")
    parser.add_argument("--device", default="cpu", help="where the decode paths run")
    parser.add_argument("--paths", nargs="+", help="decode paths (default: graph and eager on cuda, static and eager on cpu)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per generate call")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("RLCTL_TORCH_THREADS", "2")))
    paths = args.paths or (["graph", "eager"] if args.device == "cuda" else ["static", "eager"])
    steps: dict[str, dict[str, float]] = {}
    for path in paths:
        engine = TorchEngine(model(MODEL_SIZES["default"]), SamplingConfig(eos_id=-1), device=args.device, decode=path)
        steps[path] = decode_ms_per_step(torch, engine, tuple(args.batches), args.new_tokens)
        print(f"[engine_decode] {path} ms per step by batch: {steps[path]}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        results[str(rows)] = measure_rows(rows, args.filled, args.max_len)
        print(f"[engine_decode] rows {rows}: {results[str(rows)]}", file=sys.stderr, flush=True)
    print(json.dumps({"config": vars(args), "threads": torch.get_num_threads(), "decode_ms_per_step": steps,
                      "by_rows": results}))


if __name__ == "__main__":
    main()
