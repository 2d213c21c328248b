"""Simulator speed: 8,192 GPUs × 7 days of virtual time must take under 60 s on this machine.

Heartbeats are aggregated per node analytically (the detector is primed with a node's recent
inter-arrivals only when it must judge a silence), so 1 Hz beats from ~1,000 nodes cost nothing
while every verdict still comes from the real Detector. Runs the role policy under 10% per-step
failure injection and under the Llama 3 per-GPU-hour mix; reports the median of a few repeats
and CPU time (the machine is shared: CPU time is the steadier figure).

    python bench/sim_speed.py [--repeats 3]

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.sim.calibrate import make_failure_model
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.spec_loader import load_job_file

GPUS = 8192
DAYS = 7.0
BUDGET_S = 60.0


def one(spec: Any, model: str, rate: float | None, seed: int) -> dict[str, Any]:
    sim = Simulation(spec, CostModel(), make_failure_model(model, rate, seed, None),
                     SimConfig(policy="role", steps=10**9, duration_s=DAYS * 86400, seed=seed, gpus=GPUS))
    wall, cpu = time.perf_counter(), time.process_time()
    result = sim.run()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "steps": result["steps_done"],
            "events": result["events"], "faults": result["faults_injected"], "ettr": result["ettr"],
            "nodes": sum(result["nodes"].values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    out: dict[str, Any] = {"bench": "sim_speed", "gpus": GPUS, "virtual_days": DAYS, "budget_s": BUDGET_S}
    for model, rate in (("step", 0.1), ("gpu-hours", None)):
        runs = [one(spec, model, rate, seed) for seed in range(1, args.repeats + 1)]
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        out[model] = {"median_wall_s": round(wall, 2), "median_cpu_s": round(cpu, 2), "max_wall_s": round(max(r["wall_s"] for r in runs), 2),
                      "steps": runs[0]["steps"], "events": runs[0]["events"], "faults": runs[0]["faults"],
                      "ettr": runs[0]["ettr"], "nodes": runs[0]["nodes"],
                      "virtual_per_wall": round(DAYS * 86400 / wall), "under_budget": wall < BUDGET_S}
        print(f"{model}: median {wall:.1f} s wall ({cpu:.1f} s CPU) for {GPUS} GPUs x {DAYS:g} days, "
              f"{runs[0]['steps']} steps, {runs[0]['faults']} faults, {runs[0]['events']} events")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
