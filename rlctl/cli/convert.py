"""`rlctl convert verl`: write an rlctl job file from a verl run script's Hydra overrides.

In a verl run script, replace `python3 -m verl.trainer.main_ppo` (or `python3 -m
recipe.dapo.main_dapo`) with `rlctl convert verl --out job.toml`: the shell expands the script's
variables as before and this command receives verl's overrides. Every override is reported as
mapped, ignored or refused, with its reason; any refusal (or a malformed override) exits 2 and
writes nothing.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from rlctl.cli.common import console, err_console, fail, print_json

if TYPE_CHECKING:
    from rlctl.convert.verl import KeyDecision

convert_app = typer.Typer(help="Convert another framework's run into an rlctl job file.", no_args_is_help=True)

BACKENDS = ("local", "ssh", "slurm")
PLACEMENTS = ("colocated", "disaggregated")
CONFIG_NAMES = ("ppo_trainer", "dapo_trainer")
STATUS_STYLE = {"mapped": "green", "ignored": "dim", "refused": "bold red"}


@convert_app.command("verl")
def convert_verl(
    overrides: list[str] = typer.Argument(None, help="verl's Hydra overrides: key=value, +key=value, ~key.",
                                          show_default=False),
    out: Path = typer.Option(..., "--out", help="The job file to write."),
    backend: str = typer.Option("local", "--backend", help="The cluster section: local, ssh or slurm."),
    placement: str = typer.Option("colocated", "--placement", help="colocated (verl's hybrid engine: the engines on "
                                  "the trainer's GPUs) or disaggregated."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --out file."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: the job file and every key's fate."),
    config_name: str = typer.Option(None, "--config-name", help="Hydra's config name: ppo_trainer (main_ppo) or "
                                    "dapo_trainer (DAPO's recipe); others are refused."),
    config_path: str = typer.Option(None, "--config-path", help="Hydra's config folder (noted; the defaults are "
                                    "verl 0.9.1's own)."),
) -> None:
    """Write an rlctl job file from verl 0.9.1 main_ppo overrides, refusing what rlctl cannot carry exactly.

    Starts from verl's defaults (not rlctl's), so every value verl decides is written explicitly.
    """
    from rlctl.convert.files import FileFacts
    from rlctl.convert.verl import ConvertOptions, OverrideError, convert_verl

    if backend not in BACKENDS:
        fail(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend!r}", 2)
    if placement not in PLACEMENTS:
        fail(f"--placement: expected one of {', '.join(PLACEMENTS)}, got {placement!r}", 2)
    if placement == "disaggregated":
        fail("--placement disaggregated: verl's hybrid engine runs the engines on the trainer's GPUs, and how to "
             "split a run's GPUs between trainer and rollout nodes is not decided yet; convert with colocated and "
             "edit [roles.rollout] (placement, nodes) by hand", 2)
    if config_name is not None and config_name not in CONFIG_NAMES:
        fail(f"--config-name {config_name}: this converter knows verl 0.9.1's main_ppo defaults "
             f"({', '.join(CONFIG_NAMES)}), not another config's", 2)
    if out.exists() and not force:
        fail(f"--out {out}: the file exists (--force overwrites it)", 2)
    command_line = shlex.join(["rlctl", *sys.argv[1:]])
    try:
        result = convert_verl(list(overrides or []), ConvertOptions(backend, placement, Path(os.getcwd())),
                              FileFacts(), command_line)
    except OverrideError as exc:
        fail(str(exc), 2)
    if result.ok and result.job_text is not None:
        _write(out, result.job_text)
    if json_out:
        print_json({"job_file": str(out) if result.ok else None, "keys": [d.to_json() for d in result.decisions]})
    else:
        _summary(result.decisions, out if result.ok else None, config_path)
    for note in result.notes:
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    for decision in result.refused:
        err_console.print(f"[bold red]refused:[/] {escape(decision.verl)}: {escape(decision.reason)}",
                          highlight=False, soft_wrap=True)
    for problem in result.problems:
        err_console.print(f"[bold red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    if not result.ok:
        err_console.print(f"nothing written to {escape(str(out))}", highlight=False)
        raise typer.Exit(2)


def _write(out: Path, text: str) -> None:
    """The whole file or none of it (written beside, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, out)


def _summary(decisions: list[KeyDecision], out: Path | None, config_path: str | None) -> None:
    counts = {status: sum(1 for d in decisions if d.status == status) for status in STATUS_STYLE}
    table = Table(title="verl overrides", title_justify="left", show_lines=False)
    for column in ("verl key", "status", "rlctl key", "why"):
        table.add_column(column, overflow="fold")
    for d in decisions:
        style = STATUS_STYLE[d.status]
        table.add_row(escape(d.verl), f"[{style}]{d.status}[/]", escape(d.job_key or ""), escape(d.reason))
    console.print(table)
    console.print(", ".join(f"{n} {status}" for status, n in counts.items()), highlight=False)
    if config_path:
        console.print(f"--config-path {config_path}: the defaults are verl 0.9.1's own, not that folder's",
                      highlight=False, markup=False)
    if out is not None:
        console.print(f"wrote {out}: check it with `rlctl launch --dry-run {out}`; rlctl adds a spare node for fault "
                      "tolerance ([spares] nodes = 1)", highlight=False, markup=False)
