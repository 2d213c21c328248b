"""`rlctl status`, `jobs`, `nodes`, `events`, `stop`, `resume`: reading and steering running jobs."""

from __future__ import annotations

import time
from typing import Any

import typer
from rich.live import Live
from rich.table import Table

from rlctl.cli.common import (
    STATE_DIR_OPTION,
    client_for,
    console,
    err_console,
    fail,
    job_status,
    print_json,
    resolve_job,
)
from rlctl.cli.render import nodes_table, render_status, status_line, styled
from rlctl.controller.api import ApiError
from rlctl.controller.jobdir import JobDir, list_jobs, state_root
from rlctl.controller.store import Journal


def status(
    job: str = typer.Argument(None, help="Job id or unique prefix (default: the newest job)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh live until the job ends or Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between refreshes with --watch."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: str = STATE_DIR_OPTION,
) -> None:
    """Show a job: ETTR, roles, nodes, the rollout round and the latest events."""
    jobdir = resolve_job(job, state_dir)
    if json_out:
        print_json(job_status(jobdir))
        return
    if watch:
        watch_status(jobdir, interval=interval, until_done=False)
        return
    console.print(render_status(job_status(jobdir), console.width))


def watch_status(jobdir: JobDir, interval: float, until_done: bool) -> dict[str, Any]:
    """The live view; plain lines when stdout is not a terminal. Returns the last status."""
    current = job_status(jobdir)
    try:
        if not console.is_terminal:
            while True:
                console.print(status_line(current), highlight=False, soft_wrap=True)
                if current["job"]["state"] in ("succeeded", "stopped", "failed"):
                    return current
                time.sleep(max(interval, 2.0))
                current = job_status(jobdir)
        with Live(render_status(current, console.width), console=console, refresh_per_second=4, screen=False) as live:
            while current["job"]["state"] not in ("succeeded", "stopped", "failed"):
                time.sleep(interval)
                current = job_status(jobdir)
                live.update(render_status(current, console.width))
    except KeyboardInterrupt:
        pass
    return current


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
            if job_status(jobdir)["job"]["state"] in ("succeeded", "stopped", "failed") and not client_for(jobdir).available():
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        return
    finally:
        journal.close()


def stop(
    job: str = typer.Argument(..., help="Job id or unique prefix."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until every node is released."),
    json_out: bool = typer.Option(False, "--json"),
    state_dir: str = STATE_DIR_OPTION,
) -> None:
    """Stop a job: workers stopped, agents shut down, nodes released. Nothing the job produced is deleted.
    With no live controller, the job is stopped through its backend and the stop is journaled."""
    jobdir = resolve_job(job, state_dir)
    client = client_for(jobdir)
    try:
        client.call("stop", reason="stopped by the operator")
    except ApiError as exc:
        snap = job_status(jobdir)
        if snap["job"]["state"] in ("succeeded", "stopped", "failed"):
            if json_out:
                print_json({"job_id": jobdir.job_id, "state": snap["job"]["state"], "already_ended": True})
            else:
                console.print(f"{jobdir.job_id} already ended ({snap['job']['state']})")
            return
        _stop_offline(jobdir, str(exc), json_out)
        return
    state = "stopping"
    if wait:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and client.available():
            time.sleep(0.2)
        state = job_status(jobdir)["job"]["state"]
    if json_out:
        print_json({"job_id": jobdir.job_id, "state": state})
    else:
        console.print(f"{jobdir.job_id}: {state}")


def _stop_offline(jobdir: JobDir, why: str, json_out: bool) -> None:
    """No controller answers: stop the job through its backend (which also fences a paused one)."""
    import asyncio

    from rlctl.controller.offline import OfflineStopError, stop_offline
    from rlctl.core.spec import SpecError
    from rlctl.jobfile import make_backend
    from rlctl.specfile import load_job_dir_spec

    try:
        spec = load_job_dir_spec(jobdir)
        backend = make_backend(spec, jobdir)
    except (SpecError, OSError) as exc:
        fail(f"{jobdir.job_id}: no controller answers ({why}) and its job file cannot be read: {exc}")
    err_console.print(f"no controller answers for {jobdir.job_id} ({why}); stopping it through the "
                      f"{spec.backend} backend", highlight=False)
    try:
        result = asyncio.run(stop_offline(jobdir, spec, backend, "stopped by the operator (no controller ran)"))
    except OfflineStopError as exc:
        fail(f"{jobdir.job_id}: the {spec.backend} backend could not release the job's nodes: {exc}")
    if json_out:
        print_json({"job_id": jobdir.job_id, "state": result.state, "step": result.step, "offline": True,
                    "nodes_released": result.nodes_released, "workers_stopped": result.workers_stopped})
    else:
        console.print(f"{jobdir.job_id}: {result.state} at step {result.step} ({result.nodes_released} node(s) "
                      f"released through the backend, {result.workers_stopped} worker(s) stopped)")


def _brief(data: dict[str, Any]) -> str:
    parts = []
    for key, value in data.items():
        if key in ("response_tokens", "facts", "order", "last_seen", "silent", "prompts", "source", "scores", "item_ids"):
            value = f"<{len(value)} items>" if hasattr(value, "__len__") else value
        parts.append(f"{key}={value}")
    return " ".join(parts)[:300]
