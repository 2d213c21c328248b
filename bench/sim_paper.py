"""RobustRL's headline, simulated: 256 GPUs, 10% failure injection, `role` vs `full-restart`.

"10% failure injection" (DESIGN.md): at every RL step, with probability 0.1, one fault hits one
random role node (kind drawn from the Llama 3 unplanned-interruption mix). Each policy runs the
same job, cost model and failure seed; medians over seeds. RobustRL reports ETTR > 80% vs 60%
(ByteRobust-style full restart) and 8.4-17.4% faster end to end (arXiv 2512.22492).

    python bench/sim_paper.py                 # the headline (median of 5 seeds), with a colocated row (role policy)
    python bench/sim_paper.py --sweep         # + failure-rate and cluster-size sweeps, table + plot
    python bench/sim_paper.py --calibrate gpucheck.json   # weights.* measured (a GPU-check report or a job dir)
    python bench/sim_paper.py --recipe dapo   # the same job under DAPO's recipe against plain GRPO (role policy)

With ``--recipe dapo`` the job runs as it is (GRPO: one update a step, no filtering) and with verl's
DAPO recipe (``rlctl.sim.recipe.dapo_algorithm``: clip-higher, dynamic sampling on accuracy, the
overlong buffer, 16 updates a step, no KL), each part of DAPO alone, and DAPO at two other shares of
constant groups (``workload.constant_group_fraction``); same seeds, medians, and each arm's mean step
against GRPO's. The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.sim.calibrate import measured_weights
from rlctl.sim.costmodel import CostModel, load_cost_model
from rlctl.sim.engine import SimConfig, simulate
from rlctl.sim.faults import StepFailures
from rlctl.sim.layout import colocated_spec
from rlctl.sim.recipe import dapo_algorithm
from rlctl.sim.report import compare, median_runs, plot_ledger, plot_sweeps
from rlctl.spec_loader import load_job_file

POLICIES = ("role", "full-restart")
UNTIL_DURATION = 10**9  # steps: run until the virtual duration ends
ROBUSTRL = {"ettr_role": ">0.80", "ettr_full_restart": 0.60, "end_to_end_faster_pct": "8.4-17.4"}
# DAPO-Math-17K's ~17k prompts (arXiv 2503.14476): dynamic sampling spends a step's constant groups for
# the epoch, and the quickstart's 64 prompts cannot fill a batch once about half the groups are constant.
RECIPE_DATASET_PROMPTS = 17_000


def run_policy(spec: Any, cost: CostModel, policy: str, rate: float, gpus: int, seeds: list[int], steps: int | None,
               duration_s: float) -> list[dict[str, Any]]:
    return [simulate(spec, cost, StepFailures(p=rate, seed=seed),
                     SimConfig(policy=policy, steps=steps, duration_s=duration_s, seed=seed, gpus=gpus))
            for seed in seeds]


def headline(spec: Any, cost: CostModel, seeds: list[int], steps: int) -> dict[str, Any]:
    runs = {p: run_policy(spec, cost, p, 0.1, 256, seeds, steps, 30 * 86400.0) for p in POLICIES}
    medians = {p: median_runs(r) for p, r in runs.items()}
    # The same job and GPUs with the engines colocated on the trainer nodes (role policy), and its
    # fault-free time: colocation trains on every GPU but makes every node a trainer node.
    colocated = colocated_spec(spec)
    medians["colocated"] = median_runs(run_policy(colocated, cost, "role", 0.1, 256, seeds, steps, 30 * 86400.0))
    clean = {"role": median_runs(run_policy(spec, cost, "role", 0.0, 256, seeds[:1], steps, 30 * 86400.0)),
             "colocated": median_runs(run_policy(colocated, cost, "role", 0.0, 256, seeds[:1], steps, 30 * 86400.0))}
    speedups = [compare(a, b)["end_to_end_faster_pct"] for a, b in zip(runs["role"], runs["full-restart"])]
    plot_ledger({"runs": {p: r[len(r) // 2] for p, r in runs.items()}}, ROOT / "docs" / "figures" / "sim_ledger_256.png")
    return {"gpus": 256, "rate": 0.1, "steps": steps, "seeds": len(seeds),
            "role": medians["role"], "full_restart": medians["full-restart"], "colocated": medians["colocated"],
            "fault_free_end_to_end_s": {name: run["end_to_end_s"] for name, run in clean.items()},
            "colocation_cost_model": {"train_s": "step.train_s x split trainer nodes / colocated trainer nodes "
                                      "(linear, optimistic) + step.colocation_switch_s",
                                      "colocation_switch_s": cost.step.colocation_switch_s,
                                      "generation": "unchanged: bound by the longest response's per-token latency"},
            "end_to_end_faster_pct": round(statistics.median(speedups), 2),
            "end_to_end_faster_pct_range": [round(min(speedups), 2), round(max(speedups), 2)],
            "robustrl_reported": ROBUSTRL}


def sweep(spec: Any, cost: CostModel, seeds: list[int], duration_s: float) -> dict[str, Any]:
    rate_rows, size_rows = [], []
    for rate in (0.0, 0.02, 0.05, 0.1, 0.15, 0.2):
        for policy in POLICIES:
            m = median_runs(run_policy(spec, cost, policy, rate, 256, seeds, UNTIL_DURATION, duration_s))
            rate_rows.append({"rate": rate, "policy": policy, "ettr": m["ettr"], "steps": m["steps_done"]})
    for gpus in (64, 256, 1024, 4096, 8192):
        for policy in POLICIES:
            m = median_runs(run_policy(spec, cost, policy, 0.1, gpus, seeds, UNTIL_DURATION, duration_s))
            size_rows.append({"gpus": gpus, "policy": policy, "ettr": m["ettr"], "steps": m["steps_done"]})
    plot_sweeps(rate_rows, size_rows, ROOT / "docs" / "figures" / "sim_sweep.png")
    return {"duration_h": duration_s / 3600, "seeds": len(seeds), "by_rate": rate_rows, "by_gpus": size_rows}


def recipe_arms(job: Path, cost: CostModel) -> dict[str, tuple[Any, CostModel]]:
    """GRPO (the job's own recipe), DAPO, each part of DAPO alone, and DAPO at two other
    constant-group shares; every arm on a data set of ``RECIPE_DATASET_PROMPTS``."""
    data = {"rollout": {"dataset_size": RECIPE_DATASET_PROMPTS}}
    dapo = dapo_algorithm(load_job_file(job))
    sampling_only = {key: value for key, value in dapo.items() if key != "ppo_mini_batch_size"}
    updates_only = {**dapo, "filter_groups": {"enable": False}}
    arms = {"grpo": (load_job_file(job, tables=data), cost),
            "dapo": (load_job_file(job, tables={**data, "algorithm": dapo}), cost),
            "dapo, dynamic sampling only": (load_job_file(job, tables={**data, "algorithm": sampling_only}), cost),
            "dapo, mini-batches only": (load_job_file(job, tables={**data, "algorithm": updates_only}), cost)}
    for share in (0.2, 0.6):
        shared = replace(cost, workload=replace(cost.workload, constant_group_fraction=share))
        arms[f"dapo, constant groups {share:g}"] = (arms["dapo"][0], shared)
    return arms


def recipe_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds of what the recipe adds to a run's summary."""
    def med(section: str | None, key: str) -> float | None:
        values = [(r.get(section) or {}).get(key) if section else r.get(key) for r in runs]
        present = [v for v in values if v is not None]
        return round(statistics.median(present), 4) if present else None

    return {"extra_generation": med(None, "extra_generation"),
            "refills_per_step": med("dynamic_sampling", "refills_per_step"),
            "refill_generation_s_per_step": med("dynamic_sampling", "refill_generation_s_per_step"),
            "gen_batches_per_step": med("dynamic_sampling", "gen_batches_per_step"),
            "filtered_share": med("dynamic_sampling", "filtered_share"),
            "updates_per_step": med("mini_batches", "updates_per_step") or 1,
            "training_s_per_step": med(None, "training_s_per_step")}


def recipe_table(job: Path, cost: CostModel, seeds: list[int], steps: int) -> dict[str, Any]:
    """Every arm of ``recipe_arms`` on the paper job (256 GPUs, 10% failure injection, role policy),
    medians over ``seeds``, and fault-free (the first seed)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, (spec, arm_cost) in recipe_arms(job, cost).items():
        runs = run_policy(spec, arm_cost, "role", 0.1, 256, seeds, steps, 30 * 86400.0)
        clean = run_policy(spec, arm_cost, "role", 0.0, 256, seeds[:1], steps, 30 * 86400.0)[0]
        rows[name] = {**median_runs(runs), **recipe_medians(runs), "fault_free_mean_step_s": clean["mean_step_s"],
                      "states": sorted({r["state"] for r in runs})}
    base = rows["grpo"]
    for row in rows.values():
        row["step_time_vs_grpo"] = round(row["mean_step_s"] / base["mean_step_s"], 3)
        row["fault_free_step_time_vs_grpo"] = round(row["fault_free_mean_step_s"] / base["fault_free_mean_step_s"], 3)
        row["ettr_points_vs_grpo"] = round(100 * (row["ettr"] - base["ettr"]), 2)
    return {"gpus": 256, "rate": 0.1, "policy": "role", "steps": steps, "seeds": len(seeds), "job": str(job),
            "dataset_prompts": RECIPE_DATASET_PROMPTS,
            "constant_group_fraction": cost.workload.constant_group_fraction,
            "optimizer_s": cost.step.optimizer_s, "logprob_pass_ratio": round(cost.step.logprob_pass_ratio, 4),
            "arms": rows}


def print_recipe_table(table: dict[str, Any]) -> None:
    print("| arm | ETTR | mean step (s) | x GRPO | fault-free step (s) | x GRPO | end to end (h) | extra generation "
          "| refills / step | gen batches / step | updates / step | training / step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in table["arms"].items():
        if m["end_to_end_s"] is None:
            print(f"| {name} | {m['ettr']:.1%} | {', '.join(m['states'])} after {m['steps_done']:g} steps |")
            continue
        refills = "-" if m["refills_per_step"] is None else f"{m['refills_per_step']:.2f}"
        batches = "-" if m["gen_batches_per_step"] is None else f"{m['gen_batches_per_step']:.2f}"
        print(f"| {name} | {m['ettr']:.1%} | {m['mean_step_s']:.0f} | {m['step_time_vs_grpo']:.2f} "
              f"| {m['fault_free_mean_step_s']:.0f} | {m['fault_free_step_time_vs_grpo']:.2f} "
              f"| {m['end_to_end_s'] / 3600:.2f} | {m['extra_generation']:+.0%} | {refills} | {batches} "
              f"| {m['updates_per_step']:g} | {m['training_s_per_step']:.0f} |")


def print_tables(result: dict[str, Any]) -> None:
    h = result["headline"]
    print("| policy | ETTR | end to end (h) | productive | recovery | lost | detection | init |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("role", "full_restart", "colocated"):
        m = h[name]
        f = m["ledger_fraction"]
        print(f"| {name} | {m['ettr']:.1%} | {m['end_to_end_s'] / 3600:.2f} | {f['productive']:.1%} | {f['recovery']:.1%} "
              f"| {f['lost']:.1%} | {f['detection']:.1%} | {f['init']:.1%} |")
    print(f"\nrole is {h['end_to_end_faster_pct']}% faster end to end (range over seeds {h['end_to_end_faster_pct_range']})")
    if "sweep" in result:
        for key, label in (("by_rate", "rate"), ("by_gpus", "gpus")):
            rows = result["sweep"][key]
            print(f"\n| {label} | role ETTR | full-restart ETTR |\n|---|---|---|")
            for value in sorted({r[label] for r in rows}):
                cells = {r["policy"]: r["ettr"] for r in rows if r[label] == value}
                print(f"| {value} | {cells['role']:.1%} | {cells['full-restart']:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "quickstart.toml")
    parser.add_argument("--cost-model", type=Path, default=None)
    parser.add_argument("--calibrate", type=Path, default=None,
                        help="take weights.* (pull rate, overhead, staging) from a GPU-check report or a job's pulls")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sweep", action="store_true", help="also sweep failure rate (0-20%%) and GPUs (64-8192)")
    parser.add_argument("--sweep-seeds", type=int, default=2)
    parser.add_argument("--sweep-duration-h", type=float, default=24.0)
    parser.add_argument("--recipe", choices=["dapo"], default=None,
                        help="instead of the headline: the job under DAPO's recipe against plain GRPO")
    args = parser.parse_args()
    spec = load_job_file(args.job)
    cost = load_cost_model(args.cost_model)
    measured = measured_weights(args.calibrate) if args.calibrate is not None else None
    if measured is not None:
        cost = replace(cost, weights=measured.applied(cost.weights))
    started = time.perf_counter()
    if args.recipe is not None:
        table = recipe_table(args.job, cost, list(range(1, args.seeds + 1)), args.steps)
        print_recipe_table(table)
        print(json.dumps({"bench": "sim_paper", "recipe": args.recipe, **table,
                          "bench_wall_s": round(time.perf_counter() - started, 2)}))
        return
    result: dict[str, Any] = {"bench": "sim_paper", "headline": headline(spec, cost, list(range(1, args.seeds + 1)), args.steps)}
    result["weights"] = {"calibration": measured.as_dict() if measured is not None else None,
                         "bandwidth_gbps": cost.weights.bandwidth_bytes_per_s / 1e9,
                         "overhead_s": cost.weights.overhead_s, "stage_gbps": cost.weights.stage_bytes_per_s / 1e9}
    if args.sweep:
        result["sweep"] = sweep(spec, cost, list(range(1, args.sweep_seeds + 1)), args.sweep_duration_h * 3600)
    result["bench_wall_s"] = round(time.perf_counter() - started, 2)
    print_tables(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
