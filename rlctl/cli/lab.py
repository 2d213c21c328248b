"""``rlctl lab up|down|status``: the local Slurm + sshd test cluster (needs root).

Thin: all work is in :mod:`rlctl.lab`; this module parses options and renders the result as a
rich table or, with ``--json``, as one JSON object on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from rlctl import lab

lab_app = typer.Typer(
    help="A real local Slurm + sshd cluster (one network namespace per node) for trying rlctl and for tests. Root only.",
    no_args_is_help=True,
    add_completion=False,
)

StateDir = Annotated[Path, typer.Option("--state-dir", help="Where the lab keeps configs, keys, logs.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def _fail(message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"ok": False, "error": message}))
    else:
        Console(stderr=True).print(f"[bold red]error:[/] {message}")
    raise typer.Exit(1)


def _render(status: lab.LabStatus, console: Console) -> None:
    if not status.nodes:
        console.print(f"no lab in {status.state_dir} (start one with `rlctl lab up --nodes 4`)")
        return
    table = Table(title=f"rlctl lab ({'up' if status.up else 'DEGRADED'}) - controller {status.controller_address}")
    for column in ("node", "address", "slurm", "sshd", "slurmd", "link"):
        table.add_column(column)
    for n in status.nodes:
        table.add_row(n.name, n.ip, n.slurm_state, _mark(n.sshd_up), _mark(n.slurmd_up), _mark(n.link_up))
    console.print(table)
    console.print(f"partition [bold]{status.partition}[/], {status.gpus_per_node} GPU(s)/node, "
                  f"slurmctld {'up' if status.slurmctld_up else 'DOWN'}")
    console.print(f"export SLURM_CONF={status.slurm_conf}")
    console.print(f"ssh -F {status.ssh_config} node01 hostname")
    console.print("\njob.toml snippet:\n" + status.job_toml(), markup=False, highlight=False, soft_wrap=True)


def _mark(ok: bool) -> str:
    return "[green]up[/]" if ok else "[red]down[/]"


def _emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, sort_keys=True))


@lab_app.command("up")
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", min=1, max=200, help="Number of nodes.")] = 4,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=0, max=64, help="Fake GPUs (GRES) per node.")] = 0,
    state_dir: StateDir = lab.DEFAULT_STATE_DIR,
    no_install: Annotated[bool, typer.Option("--no-install", help="Fail instead of apt-installing missing packages.")] = False,
    as_json: JsonOut = False,
) -> None:
    """Bring the lab up (idempotent; a different shape replaces the old lab)."""
    try:
        status = lab.up(nodes, gpus_per_node, state_dir=state_dir, install=not no_install)
    except lab.LabError as exc:
        _fail(str(exc), as_json)
        return
    if as_json:
        _emit({"ok": True, **status.to_dict()})
    else:
        _render(status, Console())


@lab_app.command("down")
def down(state_dir: StateDir = lab.DEFAULT_STATE_DIR, as_json: JsonOut = False) -> None:
    """Tear the lab down: no process, namespace, mount, bridge, /etc/hosts line or file left."""
    try:
        report = lab.down(state_dir=state_dir)
    except lab.LabError as exc:
        _fail(str(exc), as_json)
        return
    if as_json:
        _emit({"ok": True, "killed": report.killed, "clean": report.clean})
    else:
        Console().print(f"lab down: {report.killed} process(es) stopped, nothing left behind")


@lab_app.command("status")
def status(state_dir: StateDir = lab.DEFAULT_STATE_DIR, as_json: JsonOut = False) -> None:
    """Show the lab's nodes, their Slurm state and sshd, and the job.toml facts."""
    try:
        current = lab.status(state_dir=state_dir)
    except lab.LabError as exc:
        _fail(str(exc), as_json)
        return
    if as_json:
        _emit({"ok": True, **current.to_dict()})
    else:
        _render(current, Console())
    if current.nodes and not current.up:
        raise typer.Exit(3)
