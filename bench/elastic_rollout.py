"""Elastic rollout parallelism: the measured regroup cost and curve here, and the simulator's end-to-end gain at 128 GPUs.

Two parts, each against its baseline in the same run:

- **Measured (real engine, this machine).** ``rlctl model curve``'s measurement on a locally made
  HF checkpoint with the torch engine: decode-step seconds at degree 1 and 2 (on CPU a degree is
  an intra-op thread) for several batch sizes, fitted; the regroup cost (rebuild at the other
  degree plus loading the held weights); and what the cost model decides for a long round of the
  reference job with those figures.
- **Simulated (128 GPUs).** The same job and failure seed with elastic rollout off and on (the
  cost-model policy, the cost model's ``generation.wide_per_token_ratio`` and ``regroup_s``), at
  10% failure injection and fault-free; plus a sensitivity sweep over the ratio and the regroup
  time, since neither was measured on a GPU here.

    python bench/elastic_rollout.py            # about a minute
    python bench/elastic_rollout.py --seeds 5

The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.core.elastic import ElasticConfig, choose_tensor_parallel, curve_from_json
from rlctl.sim.costmodel import CostModel, load_cost_model
from rlctl.sim.engine import SimConfig, simulate
from rlctl.sim.faults import StepFailures
from rlctl.sim.layout import elastic_spec
from rlctl.sim.report import median_runs
from rlctl.spec_loader import load_job_file

GPUS = 128


def measure(size: str, tokens: int, batches: list[int]) -> dict[str, Any]:
    """The torch engine's curve and regroup cost on a ``size`` checkpoint made here."""
    import torch

    from rlctl.workload.engine import SamplingConfig, TorchEngine
    from rlctl.workload.engine_curve import measure_curve
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_model import load_hf_policy

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model"
        init_checkpoint(path, "qwen3", size, 0)
        policy = load_hf_policy(path, "cpu")
        vocab = int(policy.config.vocab_size)
        state = {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}
        engine = TorchEngine(policy, SamplingConfig(eos_id=-1, pad_id=0), device="cpu")
        measured = measure_curve(engine, state, [1, 2], batches, tokens, vocab)
    fitted = curve_from_json(measured)
    return {"size": size, "parameters": sum(t.numel() for t in state.values()), **measured, "fitted": fitted.to_json()}


def decision_for(curve: dict[str, Any], engines: int, samples: int, tokens: int) -> dict[str, Any]:
    fitted = curve_from_json(curve)
    decision = choose_tensor_parallel(ElasticConfig(1, 2, engines, fitted), samples, tokens)
    return {"engines": engines, "samples": samples, "tokens": tokens, "tensor_parallel": decision.tensor_parallel,
            **decision.as_data()}


def simulated(spec: Any, cost: CostModel, seeds: list[int], steps: int, rate: float) -> dict[str, Any]:
    def runs(job: Any, model: CostModel) -> list[dict[str, Any]]:
        return [simulate(job, model, StepFailures(p=rate, seed=seed),
                         SimConfig(policy="role", steps=steps, duration_s=30 * 86400.0, seed=seed, gpus=GPUS))
                for seed in seeds]

    base, elastic = runs(spec, cost), runs(elastic_spec(spec), cost)
    gains = [100.0 * (b["end_to_end_s"] - e["end_to_end_s"]) / b["end_to_end_s"] for b, e in zip(base, elastic)]
    mb, me = median_runs(base), median_runs(elastic)
    return {"rate": rate, "static_end_to_end_h": round(mb["end_to_end_s"] / 3600, 3),
            "elastic_end_to_end_h": round(me["end_to_end_s"] / 3600, 3), "static_ettr": mb["ettr"], "elastic_ettr": me["ettr"],
            "rounds": elastic[0].get("rounds", {}), "faster_pct": round(statistics.median(gains), 2),
            "faster_pct_range": [round(min(gains), 2), round(max(gains), 2)]}


def sensitivity(spec: Any, cost: CostModel, steps: int) -> list[dict[str, Any]]:
    rows = []
    for ratio in (0.5, 0.65, 0.8, 0.95):
        for regroup_s in (15.0, 60.0):
            model = replace(cost, generation=replace(cost.generation, wide_per_token_ratio=ratio, regroup_s=regroup_s))
            row = simulated(spec, model, [1], steps, 0.0)
            rows.append({"wide_per_token_ratio": ratio, "regroup_s": regroup_s, "faster_pct": row["faster_pct"],
                         "regrouped_rounds": row["rounds"].get("regrouped", 0), "long_rounds": row["rounds"].get("long", 0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "quickstart.toml")
    parser.add_argument("--cost-model", type=Path, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", default="small", help="checkpoint size measured (rlctl model init --size)")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    started = time.perf_counter()
    spec = load_job_file(args.job)
    cost = load_cost_model(args.cost_model)
    measured = measure(args.size, args.tokens, [1, 4, 16])
    # The reference job's long round: 4 prompts x 4 samples to 48 tokens on one node's 2 engines.
    local = decision_for(measured, engines=2, samples=16, tokens=48)
    seeds = list(range(1, args.seeds + 1))
    result: dict[str, Any] = {
        "bench": "elastic_rollout",
        "measured": measured,
        "local_long_round_decision": local,
        "sim_128": {"faults_10pct": simulated(spec, cost, seeds, args.steps, 0.1),
                    "fault_free": simulated(spec, cost, seeds[:1], args.steps, 0.0)},
        "sim_cost_model": {"per_token_s": cost.generation.per_token_s,
                           "wide_per_token_ratio": cost.generation.wide_per_token_ratio,
                           "regroup_s": cost.generation.regroup_s,
                           "long round": "overhead_s + per_token_s x ratio x critical-path tokens + 2 x regroup_s",
                           "decision": "the round scheduler's choose_tensor_parallel with the cost model's curve"},
        "sensitivity_fault_free": sensitivity(spec, cost, args.steps),
    }
    result["bench_wall_s"] = round(time.perf_counter() - started, 2)
    m = result["measured"]["fitted"]["lines"]
    print(f"torch engine ({args.size}): degree 1 {m['1'][0] * 1e3:.3f} ms + {m['1'][1] * 1e3:.4f} ms/seq, "
          f"degree 2 {m['2'][0] * 1e3:.3f} ms + {m['2'][1] * 1e3:.4f} ms/seq; regroup {measured['regroup_s']:.4f} s")
    print(f"local long round: degree {local['tensor_parallel']} (base {local['base_s']:.3f} s, wide {local['wide_s']:.3f} s)")
    for name, row in result["sim_128"].items():
        print(f"sim {GPUS} GPUs {name}: static {row['static_end_to_end_h']} h, elastic {row['elastic_end_to_end_h']} h, "
              f"{row['faster_pct']}% faster; rounds {row['rounds']}")
    for row in result["sensitivity_fault_free"]:
        print(f"  ratio {row['wide_per_token_ratio']}, regroup {row['regroup_s']:.0f} s: {row['faster_pct']}% "
              f"({row['regrouped_rounds']}/{row['long_rounds']} long rounds regrouped)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
