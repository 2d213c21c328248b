"""`rlctl report`: a job's ETTR, its categories and every fault, from the journal (`--plot` draws it)."""

from __future__ import annotations

import typer
from rich.table import Table

from rlctl.cli.common import console, fail, print_json, resolve_job


def report(
    job: str = typer.Argument(None, help="Job id or prefix (default: the newest job)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: str = typer.Option(None, "--plot", help="Write a timeline PNG (steps, faults, recoveries, ETTR)."),
    state_dir: str = typer.Option(None, "--state-dir"),
) -> None:
    """ETTR and per-category seconds, each fault's detection and recovery latency, trajectories lost."""
    from rlctl.controller.reporting import build_report, plot_report

    jobdir = resolve_job(job, state_dir)
    data, timeline = build_report(jobdir)
    if plot:
        try:
            plot_report(data, timeline, plot)
        except ModuleNotFoundError:
            fail("--plot needs matplotlib: pip install 'rlctl[plot]'")
    if json_out:
        print_json(data)
        return
    console.print(f"[bold]{data['job_id']}[/]  {data['state']}  policy {data['policy']}  steps {data['steps']}  "
                  f"wall {data['wall_s']:.1f}s  [bold]ETTR {data['ettr'] * 100:.1f}%[/]")
    console.print("  " + "  ".join(f"{k} {v:.1f}s" for k, v in data["seconds"].items()))
    console.print(f"  trajectories stored {data['trajectories_stored']}, lost {data['trajectories_lost']}")
    for entry in data["held_out"]:
        console.print(f"  held-out reward v{entry['version']}: {entry['reward_mean']:.3f} ± {entry['reward_std_err']:.3f} "
                      f"(accuracy {entry['accuracy']:.3f}, {entry['prompts']} prompts)")
    reward = data["reward_function"]
    extras = "  ".join(f"{name} {m['mean']:.3f} (n {m['samples']})" for name, m in reward["metrics"].items())
    if extras or reward["function_failures"]:
        console.print(f"  reward function: {extras or 'no extra metrics'}; failures {reward['function_failures']}")
    table = Table(title="faults", title_justify="left")
    for column in ("fault", "kind", "verdict", "node", "injected", "detected", "recovered", "detect s", "recover s", "action"):
        table.add_column(column)
    for f in data["faults"]:
        table.add_row(f["fault_id"], f["kind"], f["verdict"], f["node"], _t(f["occurred_s"]), _t(f["detected_s"]),
                      _t(f["recovered_s"]), _t(f["detection_s"]), _t(f["recovery_s"]), f["action"])
    console.print(table)
    if plot:
        console.print(f"timeline written to {plot}")


def _t(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
