"""Chaos ETTR benchmark: the reference job under per-step fault injection, `role` vs `full-restart`.

Same job, same seed, same fault draws for both policies, in one run. Also a fault-free run that
must raise zero verdicts. "10% failure injection" = at each RL step, probability 0.1 that a
fault of a random kind hits one random node of the job (DESIGN.md).

    python bench/chaos_ettr.py [--steps 120] [--rate 0.1] [--seed 0] [--sweep 0.05,0.1,0.2] [--step-scale 1] [--rl-stages]
    python bench/chaos_ettr.py --placements [--steps 60] [--clean-steps 30]   # colocated vs disaggregated
    python bench/chaos_ettr.py --elastic [--steps 40]   # 2 engines a rollout node that regroup for long rounds
    python bench/chaos_ettr.py --template [--steps 80]  # role policy: workers forked from the template vs spawned

Prints progress to stderr and one JSON object on the last stdout line.
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
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobrun import rlctl

from rlctl.controller.jobdir import JobDir
from rlctl.controller.reporting import build_report
from rlctl.controller.store import Journal
from rlctl.lab.reference_jobs import write_job, write_rl_stages_env

KINDS = "crash,hang,node-down,agent-kill,xid,nccl-timeout"


def log(message: str) -> None:
    print(f"[chaos_ettr {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# Two layouts on the same nodes (3 role nodes and a spare, one simulated GPU each): the
# reference job's split roles against trainer ranks with an engine colocated on each node.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "disaggregated": {"trainers": 1, "rollouts": 1},
    "colocated": {"trainers": 2, "rollouts": 2, "colocated": True},
}


# Elastic rollout parallelism: one rollout node of 2 simulated GPUs (2 engines) regrouped into one
# engine of 2 for every long round (policy "always": this machine's curve would never regroup).
ELASTIC_LAYOUT: dict[str, Any] = {"trainers": 1, "rollouts": 1, "rollout_gpus_per_node": 2,
                                  "extra_tables": '\n[rollout.elastic]\nenabled = true\npolicy = "always"\n'}


def run_job(workdir: Path, policy: str, steps: int, rate: float, seed: int, step_scale: int = 1,
            rl_stages: bool = False, layout: dict[str, Any] | None = None,
            worker_template: bool | None = None) -> dict[str, Any]:
    """Launch the job, soak it with `rlctl chaos` until it finishes, return its report.
    ``worker_template``: ``[cluster] worker_template`` (None: the backend's default)."""
    env = dict(os.environ, RLCTL_HOME=str(workdir / "jobs"), UCX_NET_DEVICES="lo", UCXPY_PROGRESS_MODE="blocking",
               UCX_WARN_UNUSED_ENV_VARS="n")
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    placement = dict(layout or {})
    extra = (write_rl_stages_env(workdir) if rl_stages else "") + str(placement.pop("extra_tables", ""))
    spec = write_job(workdir, name=f"bench-{policy}", steps=steps, spares=1, policy=policy, checkpoint_every=5,
                     max_restarts=2, step_scale=step_scale, extra_tables=extra, **placement)
    if worker_template is not None:
        spec.write_text(spec.read_text().replace("[cluster]\n", f"[cluster]\nworker_template = {str(worker_template).lower()}\n", 1))
    launched = json.loads(rlctl(env, "launch", str(spec), "--json").strip().splitlines()[-1])
    job = launched["job_id"]
    log(f"{policy}: launched {job} ({steps} steps, rate {rate})")
    chaos = None
    if rate > 0:
        chaos = subprocess.Popen([sys.executable, "-m", "rlctl.cli", "chaos", job, "--rate", str(rate), "--seed",
                                  str(seed), "--kinds", KINDS, "--json"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 1800
    state = ""
    while time.monotonic() < deadline:
        snap = json.loads(rlctl(env, "status", job, "--json"))
        state = snap["job"]["state"]
        if state in ("succeeded", "stopped", "failed"):
            break
        time.sleep(2.0)
    if chaos is not None:
        chaos.wait(timeout=60)
    if state not in ("succeeded", "stopped", "failed"):
        rlctl(env, "stop", job)
    report, _ = build_report(JobDir(Path(launched["job_dir"])))
    journal = Journal(Path(launched["job_dir"]) / "journal.db", readonly=True)
    report["verdicts"] = len(list(journal.read(types=("Verdict",))))
    resized = list(journal.read(types=("EngineResized",)))
    report["regroups"] = sum(1 for e in resized if int(e.data["tensor_parallel"]) > 1)  # elastic rollout only
    log(f"{policy}: {report['state']} in {report['wall_s']:.0f}s, ETTR {report['ettr']:.3f}, "
        f"{len(report['faults'])} faults")
    return report


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 3), "p95": round(p95, 3), "n": len(ordered)}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    detection: dict[str, list[float]] = defaultdict(list)
    recovery: dict[str, list[float]] = defaultdict(list)
    for fault in report["faults"]:
        if not fault["injected"]:
            continue
        if fault["detection_s"] is not None:
            detection[fault["kind"]].append(fault["detection_s"])
        if fault["recovery_s"] is not None:
            recovery[fault["kind"]].append(fault["recovery_s"])
    return {
        "state": report["state"],
        "ettr": report["ettr"],
        "wall_s": report["wall_s"],
        "steps": report["steps"],
        "seconds": report["seconds"],
        "faults_injected": sum(1 for f in report["faults"] if f["injected"]),
        "faults_unrecovered": sum(1 for f in report["faults"] if f["recovered_s"] is None and not f.get("refused")),
        "trajectories_lost": report["trajectories_lost"],
        "regroups": report["regroups"],
        "detection_s": {k: percentiles(v) for k, v in sorted(detection.items())},
        "recovery_s": {k: percentiles(v) for k, v in sorted(recovery.items())},
        "time_per_step_s": round(report["wall_s"] / max(report["steps"], 1), 3),
        "faults": [{k: fault[k] for k in ("kind", "node", "slot", "verdict", "action", "detection_s", "recovery_s")}
                   for fault in report["faults"]],
    }


def compare_placements(args: argparse.Namespace) -> None:
    """Colocated against disaggregated on the same nodes, role policy: fault-free step time, then
    ETTR under the soak. Prints one JSON object."""
    results: dict[str, Any] = {"rate": args.rate, "steps": args.steps, "seed": args.seed, "placements": PLACEMENTS,
                               "definition": "per RL step, probability `rate` that one random node gets a random fault",
                               "kinds": KINDS.split(",")}
    with tempfile.TemporaryDirectory(prefix="rlctl-placement-") as tmp:
        for name, layout in PLACEMENTS.items():
            clean = run_job(Path(tmp) / f"{name}-clean", "role", args.clean_steps, 0.0, args.seed, args.step_scale,
                            layout=layout)
            soaked = summarize(run_job(Path(tmp) / f"{name}-soak", "role", args.steps, args.rate, args.seed,
                                       args.step_scale, layout=layout))
            results[name] = {"fault_free": {"verdicts": clean["verdicts"], "steps": clean["steps"],
                                            "productive_s_per_step": round(clean["seconds"]["productive"] / max(clean["steps"], 1), 3),
                                            "time_per_step_s": round(clean["wall_s"] / max(clean["steps"], 1), 3)},
                             "soak": soaked}
    results["step_time_ratio"] = round(results["disaggregated"]["fault_free"]["productive_s_per_step"]
                                       / max(results["colocated"]["fault_free"]["productive_s_per_step"], 1e-9), 3)
    print(json.dumps(results))


def compare_templates(args: argparse.Namespace) -> None:
    """The role policy with every worker forked from the host's warm template against the old spawn
    (``[cluster] worker_template`` true and false), the same fault draws: ETTR, time per step and
    recovery per fault kind. Prints one JSON object."""
    results: dict[str, Any] = {"rate": args.rate, "steps": args.steps, "seed": args.seed, "step_scale": args.step_scale,
                               "definition": "per RL step, probability `rate` that one random node gets a random fault",
                               "kinds": KINDS.split(",")}
    with tempfile.TemporaryDirectory(prefix="rlctl-template-") as tmp:
        for name, template in (("spawn", False), ("template", True)):
            results[name] = summarize(run_job(Path(tmp) / name, "role", args.steps, args.rate, args.seed,
                                              args.step_scale, worker_template=template))
    results["ettr_gain"] = round(results["template"]["ettr"] - results["spawn"]["ettr"], 4)
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", default="", help="extra rates for role vs full-restart, e.g. 0.05,0.2")
    parser.add_argument("--clean-steps", type=int, default=40, help="steps of the fault-free run")
    parser.add_argument("--step-scale", type=int, default=1,
                        help="prompts per step times this (a step does that much more work; default 1: ~1 s steps)")
    parser.add_argument("--rl-stages", action="store_true",
                        help="stream training, reward helpers and an env worker with multi-turn episodes switched on")
    parser.add_argument("--elastic", action="store_true",
                        help="elastic rollout parallelism on: 2 engines a rollout node, regrouped for every long round")
    parser.add_argument("--placements", action="store_true",
                        help="instead: colocated against disaggregated on the same nodes (role policy), fault-free and soaked")
    parser.add_argument("--template", action="store_true",
                        help="instead: the role policy with workers forked from the warm template against spawned ones")
    args = parser.parse_args()
    if args.template:
        compare_templates(args)
        return
    if args.placements:
        compare_placements(args)
        return
    layout = ELASTIC_LAYOUT if args.elastic else None
    results: dict[str, Any] = {"rate": args.rate, "steps": args.steps, "seed": args.seed, "step_scale": args.step_scale,
                               "rl_stages": args.rl_stages, "elastic": args.elastic,
                               "definition": "per RL step, probability `rate` that one random node gets a random fault",
                               "kinds": KINDS.split(",")}
    with tempfile.TemporaryDirectory(prefix="rlctl-chaos-") as tmp:
        base = Path(tmp)
        clean = run_job(base / "clean", "role", args.clean_steps, 0.0, args.seed, args.step_scale, args.rl_stages,
                        layout)
        results["fault_free"] = {"verdicts": clean["verdicts"], "ettr": clean["ettr"], "steps": clean["steps"],
                                 "time_per_step_s": round(clean["wall_s"] / max(clean["steps"], 1), 3)}
        rates = [args.rate] + [float(r) for r in args.sweep.split(",") if r.strip()]
        runs: dict[str, Any] = {}
        for rate in rates:
            for policy in ("role", "full-restart"):
                report = run_job(base / f"{policy}-{rate}", policy, args.steps, rate, args.seed, args.step_scale,
                                 args.rl_stages, layout)
                runs[f"{policy}@{rate}"] = summarize(report)
        results["runs"] = runs
    main_role, main_full = runs[f"role@{args.rate}"], runs[f"full-restart@{args.rate}"]
    results["ettr_role"] = main_role["ettr"]
    results["ettr_full_restart"] = main_full["ettr"]
    results["end_to_end_speedup"] = round(main_full["wall_s"] / max(main_role["wall_s"], 1e-9), 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
