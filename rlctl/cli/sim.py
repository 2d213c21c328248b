"""`rlctl sim`: simulate a job under faults with the real core on a virtual clock (see docs/sim.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from rlctl.cli.common import console, fail, print_json
from rlctl.core.ettr import CATEGORIES


def sim(
    job_file: Path = typer.Argument(..., help="The job spec (job.toml) to simulate."),
    gpus: int = typer.Option(None, "--gpus", help="Role GPUs (split by the cost model's shares; spares on top)."),
    rate: float = typer.Option(None, "--rate", help="Failure rate: per RL step (step model, default 0.1) or per GPU-hour "
                               "(gpu-hours model, default Llama 3's)."),
    policy: str = typer.Option("both", "--policy", help="role | full-restart | both"),
    duration: str = typer.Option("7d", "--duration", help="Virtual time limit (e.g. 24h, 7d)."),
    steps: int = typer.Option(None, "--steps", help="RL steps to run (default: the job file's; 0: until --duration)."),
    seed: int = typer.Option(0, "--seed"),
    cost_model: Path = typer.Option(None, "--cost-model", help="Cost-model TOML (docs/cost-model.md)."),
    failure_model: str = typer.Option("step", "--failure-model", help="step | gpu-hours | trace"),
    trace: Path = typer.Option(None, "--trace", help="Fault trace (JSON lines / JSON list) or a job journal.db."),
    calibrate: Path = typer.Option(None, "--calibrate", help="Measured figures. A GPU-check report (the JSON of "
                                   "`python -m rlctl.gpucheck`): its measured weight pull, overhead and staging rates "
                                   "replace the cost model's, then JOB_FILE is simulated as usual. A real job's "
                                   "directory: its whole cost model measured from its journal (weights from its own "
                                   "pulls), its faults replayed, predicted and measured ETTR compared."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: Path = typer.Option(None, "--plot", help="Write a ledger plot (PNG)."),
) -> None:
    """Simulate JOB_FILE's job on a virtual clock with a cost model and a failure model."""
    from rlctl.core.spec import SpecError
    from rlctl.sim.calibrate import make_failure_model
    from rlctl.sim.costmodel import CostModelError, load_cost_model
    from rlctl.sim.engine import POLICIES, SimConfig, compare_policies, simulate
    from rlctl.sim.faults import parse_duration
    from rlctl.sim.report import plot_ledger
    from rlctl.sim.weight_rates import MeasuredWeights, WeightRatesError, from_gpucheck, is_gpucheck_report
    from rlctl.spec_loader import load_job_file

    try:
        spec = load_job_file(job_file)
    except SpecError as exc:
        fail(str(exc), code=2)
    if calibrate is not None and not is_gpucheck_report(calibrate):
        _calibrate(calibrate, spec, seed, json_out)
        return
    if policy not in (*POLICIES, "both"):
        fail(f"--policy must be role, full-restart or both, got {policy!r}", code=2)
    measured: MeasuredWeights | None = None
    try:
        cost = load_cost_model(cost_model)
        if calibrate is not None:
            measured = from_gpucheck(calibrate)
            cost = replace(cost, weights=measured.applied(cost.weights))
        horizon = parse_duration(duration)
        make_failure_model(failure_model, rate, seed, trace)
    except (CostModelError, WeightRatesError, ValueError, OSError) as exc:
        fail(str(exc), code=2)
    total = None if steps is None else (steps or 10**9)
    config = SimConfig(policy=policy if policy != "both" else "role", steps=total, duration_s=horizon, seed=seed, gpus=gpus)
    make = lambda s: make_failure_model(failure_model, rate, s, trace)
    if policy == "both":
        result: dict[str, Any] = compare_policies(spec, cost, make, config)
    else:
        result = simulate(spec, cost, make(seed), config)
    if measured is not None:
        result["calibration"] = measured.as_dict()
    if plot is not None:
        plot_ledger(result, plot)
    if json_out:
        print_json(result)
        return
    _render(result)
    if measured is not None:
        _render_measured(measured)


def _render_measured(measured: Any) -> None:
    figures = measured.as_dict()
    stage = f", staging {figures['stage_gbps']} GB/s ({figures['stage_figure']})" if figures["stage_gbps"] else ""
    console.print(f"weights measured on {figures['hardware']} ({figures['source']}): pull {figures['pull_gbps']} GB/s, "
                  f"overhead {figures['overhead_s']} s{stage}", highlight=False)


def _calibrate(target: Path, spec: Any, seed: int, json_out: bool) -> None:
    from rlctl.sim.calibrate import journal_path, predict_from_journal

    if target.suffix == ".json":
        fail(f"{target}: not a GPU-check report (expected the JSON of `python -m rlctl.gpucheck`, a job directory "
             "or its journal.db)", code=2)
    if not journal_path(target).exists():
        fail(f"{target}: no journal.db there", code=2)
    try:
        result = predict_from_journal(target, spec, seed=seed)
    except ValueError as exc:  # rlctl.journal_reader.JournalUnreadable: not a journal it can read
        fail(str(exc), code=2)
    if json_out:
        print_json(result)
        return
    table = Table(title=f"calibration against {result['journal']}")
    for column in ("", "ETTR", "wall s", "steps", "faults"):
        table.add_column(column)
    for name in ("measured", "predicted"):
        row = result[name]
        table.add_row(name, f"{row['ettr']:.1%}", f"{row['wall_s']:.1f}", str(row["steps"]), str(row["faults"]))
    console.print(table)
    verdict = "within" if result["within_5_points"] else "outside"
    console.print(f"error {result['error_points']:+.1f} points ({verdict} the 5-point target)")


def _render(result: dict[str, Any]) -> None:
    from rlctl.sim.report import recipe_cells

    runs = result.get("runs", {result.get("policy", "run"): result})
    table = Table(title="rlctl sim")
    table.add_column("")
    for name in runs:
        table.add_column(name, justify="right")
    rows = [
        ("GPUs (incl. spares)", lambda r: str(r["gpus"])),
        ("state", lambda r: r["state"]),
        ("steps", lambda r: f"{r['steps_done']}/{r['steps_target'] if r['steps_target'] < 10**9 else '-'}"),
        ("ETTR", lambda r: f"{r['ettr']:.1%}"),
        ("end to end", lambda r: _hours(r["end_to_end_s"]) if r["end_to_end_s"] else f"> {_hours(r['wall_s'])}"),
        ("mean step", lambda r: f"{r['mean_step_s']:.0f} s" if r["mean_step_s"] else "-"),
        ("faults", lambda r: str(r["faults_injected"])),
        ("mean detection", lambda r: f"{r['mean_detection_s']:.1f} s" if r["mean_detection_s"] is not None else "-"),
        ("mean recovery", lambda r: f"{r['mean_recovery_s']:.0f} s" if r["mean_recovery_s"] is not None else "-"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in runs.values()))
    recipe = [recipe_cells(r) for r in runs.values()]
    for label in dict.fromkeys(key for cells in recipe for key in cells):
        table.add_row(label, *(cells.get(label, "-") for cells in recipe))
    for category in CATEGORIES:
        table.add_row(f"  {category}", *(f"{r['ledger_fraction'][category]:.1%}" for r in runs.values()))
    table.add_row("sim time", *(f"{r['sim_wall_clock_s']:.2f} s" for r in runs.values()))
    console.print(table)
    comparison = result.get("comparison")
    if comparison:
        console.print(f"role vs full-restart: ETTR {comparison['ettr_gap_points']:+.1f} points, "
                      f"{comparison.get('end_to_end_faster_pct', 0):.1f}% faster end to end")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"
