"""Running simulations and reporting them: one run's summary, policies side by side, sweeps, plots.

A summary is a plain dict (what ``rlctl sim --json`` prints): ETTR, the ledger in seconds and as
fractions of wall time, end-to-end time to N steps, faults, verdicts and actions, the generation
beyond the trained batches, what the recipe's dynamic sampling and mini-batches cost when the job
has them, and the simulator's own speed.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rlctl.core.ettr import CATEGORIES
from rlctl.sim.recipe import training_passes
from rlctl.sim.site import ReportSite, StepGeneration


def summarize(sim: ReportSite, wall_clock_s: float) -> dict[str, Any]:
    """One run, as a JSON-able dict."""
    model = sim.model
    ledger = model.ledger
    wall = ledger.wall
    faults = list(model.faults.values())
    detected = [f.detected_at - f.occurred_at for f in faults if f.detected_at is not None]
    recovered = [f.recovered_at - f.detected_at for f in faults if f.recovered_at is not None and f.detected_at is not None]
    return {
        "policy": model.policy,
        "seed": sim.config.seed,
        "failure_model": sim.failures.name,
        "gpus": sim.layout.total_gpus,
        "nodes": dict(sim.layout.nodes, spare=sim.layout.spares),
        "state": model.life.state.value,
        "end_reason": model.life.history[-1].reason if model.life.state.terminal else None,
        "stalled_s": round(sim.stats.stalled_s, 3),
        "steps_done": model.published_version,
        "steps_target": model.total_steps,
        "end_to_end_s": sim.end_to_end_s,
        "wall_s": round(wall, 3),
        "ettr": round(ledger.ettr(), 4),
        "ledger_s": {c: round(ledger.seconds[c], 3) for c in CATEGORIES},
        "ledger_fraction": {c: round(ledger.seconds[c] / wall, 4) if wall > 0 else 0.0 for c in CATEGORIES},
        "faults_injected": sim.stats.faults_injected,
        "faults_by_cause": dict(sorted(sim.stats.faults_by_kind.items())),
        "faults_skipped": sim.stats.faults_skipped,
        "faults_open_at_end": sum(1 for f in faults if f.open),
        "verdicts": dict(sorted(sim.orc.tally.verdicts.items())),
        "actions": dict(sorted(sim.orc.tally.actions.items())),
        "mean_detection_s": round(statistics.fmean(detected), 3) if detected else None,
        "mean_recovery_s": round(statistics.fmean(recovered), 3) if recovered else None,
        "rounds": dict(sorted(sim.stats.rounds.items())),
        "mean_step_s": round(wall / model.published_version, 3) if model.published_version else None,
        **recipe_figures(sim),
        "events": sim.stats.events,
        "sim_callbacks": sim.q.processed,
        "sim_wall_clock_s": round(wall_clock_s, 3),
    }


def recipe_figures(sim: ReportSite) -> dict[str, Any]:
    """``extra_generation``: samples generated beyond the trained batches, as a fraction of them
    (over-provisioning, deferrals, dynamic sampling's filtered groups and refills);
    ``training_s_per_step``: a step's training as priced (its recipe's passes, the layout's share);
    with ``filter_groups``, ``dynamic_sampling``; with more than one pass or update a step, or a
    no-grad forward, ``mini_batches``."""
    steps = list(sim.stats.generation.values())
    trained = sum(s.trained for s in steps)
    out: dict[str, Any] = {"extra_generation": round(sum(s.generated for s in steps) / trained - 1, 4) if trained else None,
                           "training_s_per_step": round(sim.cost.step.train_s, 3)}
    algorithm = sim.spec.algorithm
    if algorithm.filter_groups.enable:
        out["dynamic_sampling"] = _dynamic_sampling(sim, steps)
    passes = training_passes(algorithm, sim.spec.rollout.batch_prompts)
    if not passes.plain:
        out["mini_batches"] = {"updates_per_step": passes.updates, "ppo_epochs": passes.epochs,
                               "extra_updates": passes.extra_updates, "no_grad_forwards": passes.forwards,
                               "optimizer_s": sim.cost.step.optimizer_s,
                               "logprob_pass_ratio": round(sim.cost.step.logprob_pass_ratio, 4)}
    return out


def _dynamic_sampling(sim: ReportSite, steps: list[StepGeneration]) -> dict[str, Any]:
    filtering = sim.spec.algorithm.filter_groups
    filtered = sum(s.filtered for s in steps)
    groups = filtered + sum(s.groups for s in steps)
    count = max(1, len(steps))
    return {"metric": filtering.metric, "max_num_gen_batches": filtering.max_num_gen_batches,
            "constant_group_fraction": sim.cost.workload.constant_group_fraction,
            "groups_filtered": filtered, "filtered_share": round(filtered / groups, 4) if groups else None,
            "gen_batches_per_step": round(sum(s.gen_batches for s in steps) / count, 3),
            "gen_batches_max": max((s.gen_batches for s in steps), default=0),
            "refills": sim.stats.refills, "refills_per_step": round(sim.stats.refills / count, 3),
            "refill_generation_s": round(sim.stats.refill_s, 3),
            "refill_generation_s_per_step": round(sim.stats.refill_s / count, 3)}


def recipe_cells(run: dict[str, Any]) -> dict[str, str]:
    """The recipe's figures of one run as rows of ``rlctl sim``'s table (label: cell)."""
    cells: dict[str, str] = {}
    if run.get("extra_generation") is not None:
        cells["extra generation"] = f"{run['extra_generation']:+.0%}"
    sampling = run.get("dynamic_sampling")
    if sampling:
        share = sampling["filtered_share"]
        cells["groups filtered"] = f"{share:.0%} ({sampling['metric']})" if share is not None else "-"
        cells["gen batches / step"] = f"{sampling['gen_batches_per_step']:.2f} (max {sampling['gen_batches_max']})"
        cells["refills / step"] = (f"{sampling['refills_per_step']:.2f} "
                                   f"({sampling['refill_generation_s_per_step']:.0f} s)")
    updates = run.get("mini_batches")
    if updates:
        forwards = f", {updates['no_grad_forwards']} no-grad fwd" if updates["no_grad_forwards"] else ""
        cells["updates / step"] = f"{updates['updates_per_step']} ({updates['ppo_epochs']} epoch{forwards})"
        cells["training / step"] = f"{run['training_s_per_step']:.0f} s"
    return cells


def compare(role: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """ETTR gap and end-to-end speed-up (how much less time ``role`` needs for the same steps)."""
    result: dict[str, Any] = {"ettr_role": role["ettr"], "ettr_full_restart": full["ettr"],
                              "ettr_gap_points": round(100 * (role["ettr"] - full["ettr"]), 2)}
    if role["end_to_end_s"] and full["end_to_end_s"]:
        result["end_to_end_faster_pct"] = round(100 * (1 - role["end_to_end_s"] / full["end_to_end_s"]), 2)
    else:
        rate_role = role["steps_done"] / role["wall_s"] if role["wall_s"] else 0.0
        rate_full = full["steps_done"] / full["wall_s"] if full["wall_s"] else 0.0
        if rate_role > 0 and rate_full > 0:
            result["end_to_end_faster_pct"] = round(100 * (1 - rate_full / rate_role), 2)
    return result


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the headline figures over seeds."""
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    return {"ettr": med("ettr"), "end_to_end_s": med("end_to_end_s"), "steps_done": med("steps_done"),
            "wall_s": med("wall_s"), "faults_injected": med("faults_injected"),
            "mean_step_s": med("mean_step_s"), "seeds": len(runs),
            "ledger_fraction": {c: round(statistics.median(r["ledger_fraction"][c] for r in runs), 4) for c in CATEGORIES}}


def plot_sweeps(rate_rows: list[dict[str, Any]], size_rows: list[dict[str, Any]], path: Path) -> None:
    """Two panels: ETTR vs per-step failure rate, ETTR vs cluster size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, rows, key, label in ((axes[0], rate_rows, "rate", "failure injection per RL step"),
                                   (axes[1], size_rows, "gpus", "GPUs")):
        for policy, style in (("role", "o-"), ("full-restart", "s--")):
            xs = [r[key] for r in rows if r["policy"] == policy]
            ys = [r["ettr"] for r in rows if r["policy"] == policy]
            axis.plot(xs, ys, style, label=policy)
        axis.set_xlabel(label)
        axis.set_ylabel("ETTR")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        axis.legend()
    axes[1].set_xscale("log", base=2)
    axes[0].axhline(0.8, color="grey", lw=0.8, ls=":")
    axes[0].axhline(0.6, color="grey", lw=0.8, ls=":")
    fig.suptitle("rlctl sim: ETTR by recovery policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ledger(result: dict[str, Any], path: Path) -> None:
    """A stacked bar per policy: where the wall-clock time went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"] if "runs" in result else {result["policy"]: result}
    fig, axis = plt.subplots(figsize=(6, 3.6))
    names = list(runs)
    bottoms = [0.0] * len(names)
    for category in CATEGORIES:
        values = [runs[n]["ledger_fraction"][category] for n in names]
        axis.bar(names, values, bottom=bottoms, label=category)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axis.set_ylabel("fraction of wall-clock time")
    axis.set_ylim(0, 1.0)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title("ETTR ledger by policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
