"""`rlctl status`, `jobs`, `nodes`, `events`: reading running jobs (`stop` is in rlctl.cli.stop)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import typer
from rich.live import Live
from rich.table import Table

from rlctl.cli.common import (
    STATE_DIR_OPTION,
    client_for,
    console,
    fail,
    job_status,
    print_json,
    resolve_job,
)
from rlctl.cli.render import nodes_table, render_status, status_line, styled
from rlctl.controller.jobdir import JobDir, list_jobs, state_root
from rlctl.controller.store import Journal
from rlctl.core.states import ENDED_JOB_STATES


def status(
    job: str = typer.Argument(None, help="Job id or unique prefix (default: the newest job)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh live until the job ends or Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between refreshes with --watch."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object; with --watch, one per refresh "
                                                        "(a line each) until the job ends."),
    state_dir: str = STATE_DIR_OPTION,
) -> None:
    """Show a job: ETTR, roles, nodes, the rollout round and the latest events."""
    if not interval > 0:
        fail(f"--interval: expected a number of seconds above 0, got {interval:g}", code=2)
    jobdir = resolve_job(job, state_dir)
    if json_out and watch:
        stream_status(jobdir, interval)
        return
    if json_out:
        print_json(job_status(jobdir))
        return
    if watch:
        watch_status(jobdir, interval=interval)
        return
    console.print(render_status(job_status(jobdir), console.width))


def stream_status(jobdir: JobDir, interval: float) -> None:
    """``status --watch --json``: the status as one JSON line every ``interval`` seconds, the last
    one the job's end (a script follows a job with one process instead of one per poll)."""
    try:
        for current in _until_ended(jobdir, interval):
            print_json(current)
    except (KeyboardInterrupt, BrokenPipeError):
        pass


def watch_status(jobdir: JobDir, interval: float) -> dict[str, Any]:
    """The live view; plain lines when stdout is not a terminal. Returns the last status."""
    current: dict[str, Any] = {}
    try:
        if not console.is_terminal:
            for current in _until_ended(jobdir, max(interval, 2.0)):
                console.print(status_line(current), highlight=False, soft_wrap=True)
            return current
        statuses = _until_ended(jobdir, interval)
        current = next(statuses)
        with Live(render_status(current, console.width), console=console, refresh_per_second=4, screen=False) as live:
            for current in statuses:
                live.update(render_status(current, console.width))
    except KeyboardInterrupt:
        pass
    return current


def _until_ended(jobdir: JobDir, interval: float) -> Iterator[dict[str, Any]]:
    """The job's status now, then every ``interval`` seconds, up to and including its end."""
    while True:
        current = job_status(jobdir)
        yield current
        if current["job"]["state"] in ENDED_JOB_STATES:
            return
        time.sleep(interval)


def jobs(json_out: bool = typer.Option(False, "--json"), state_dir: str = STATE_DIR_OPTION) -> None:
    """List jobs with their state, step and ETTR."""
    rows = []
    for jobdir in list_jobs(state_root(state_dir)):
        try:
            snap = job_status(jobdir)["job"]
        except Exception as exc:  # noqa: BLE001 - a broken job dir must not hide the others
            snap = {"id": jobdir.job_id, "state": f"unreadable: {exc}", "step": 0, "total_steps": 0, "ettr": 0.0, "elapsed_s": 0}
        rows.append(snap)
    if json_out:
        print_json({"jobs": rows})
        return
    table = Table(title=f"jobs under {state_root(state_dir)}", title_justify="left")
    for column in ("job", "state", "step", "ETTR", "elapsed"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["id"], styled(row["state"]), f"{row['step']}/{row['total_steps']}", f"{row['ettr'] * 100:.1f}%",
                      f"{row['elapsed_s']:.0f}s")
    console.print(table)


def nodes(job: str = typer.Argument(None), json_out: bool = typer.Option(False, "--json"), state_dir: str = STATE_DIR_OPTION) -> None:
    """List a job's nodes: role, state, heartbeat age, GPU figures, last signal."""
    snap = job_status(resolve_job(job, state_dir))
    if json_out:
        print_json({"job": snap["job"]["id"], "nodes": snap["nodes"]})
        return
    console.print(nodes_table(snap, console.width))


def events(
    job: str = typer.Argument(None),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until Ctrl-C or the job ends."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    event_type: list[str] = typer.Option(None, "--type", help="Only these event types (repeatable)."),
    after: int = typer.Option(0, "--after", help="Only events after this sequence number."),
    state_dir: str = STATE_DIR_OPTION,
) -> None:
    """Print a job's journal of events."""
    jobdir = resolve_job(job, state_dir)
    journal = Journal(jobdir.journal, readonly=True)
    last = after
    types = tuple(event_type or ())
    try:
        while True:
            for ev in journal.read(after_seq=last, types=types):
                last = ev.seq
                if json_out:
                    print_json(ev.as_dict())
                else:
                    stamp = time.strftime("%H:%M:%S", time.localtime(ev.at)) + f".{int(ev.at * 1000) % 1000:03d}"
                    console.print(f"{ev.seq:6d} {stamp} [bold]{ev.type}[/] {_brief(ev.data)}", highlight=False, soft_wrap=True)
            if not follow:
                return
            if job_status(jobdir)["job"]["state"] in ENDED_JOB_STATES and not client_for(jobdir).available():
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        return
    finally:
        journal.close()


def _brief(data: dict[str, Any]) -> str:
    parts = []
    for key, value in data.items():
        if key in ("response_tokens", "facts", "order", "last_seen", "silent", "prompts", "source", "scores", "item_ids"):
            value = f"<{len(value)} items>" if hasattr(value, "__len__") else value
        parts.append(f"{key}={value}")
    return " ".join(parts)[:300]
