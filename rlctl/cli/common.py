"""Helpers shared by the CLI commands: finding jobs, getting a status, printing errors and JSON."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from rlctl.controller.api import ApiClient, ApiError
from rlctl.controller.jobdir import JobDir, find_job, list_jobs, state_root
from rlctl.controller.predecessor import controller_running

STATE_DIR_OPTION = typer.Option(None, "--state-dir", help="Where job directories live (default $RLCTL_HOME or ~/.rlctl/jobs).")

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=None, default=str) + "\n")
    sys.stdout.flush()


def resolve_job(job: str | None, state_dir: str | None = None) -> JobDir:
    try:
        return find_job(state_root(state_dir), job)
    except LookupError as exc:
        fail(str(exc))


def resolve_job_to_act_on(job: str | None, state_dir: str | None, command: str) -> JobDir:
    """The job a command that changes a job (``stop``, ``inject-fault``) acts on: without ``--job``
    the newest, unless several jobs run here, when guessing could hit the wrong one."""
    if job is None:
        running = [j for j in list_jobs(state_root(state_dir)) if controller_running(j.read_controller())]
        if len(running) > 1:
            fail(f"{command}: {len(running)} jobs are running here ({', '.join(j.job_id for j in running)}); "
                 "say which with --job", code=2)
    return resolve_job(job, state_dir)


def client_for(jobdir: JobDir) -> ApiClient:
    return ApiClient(jobdir.api_socket)


def job_status(jobdir: JobDir) -> dict[str, Any]:
    """From the live controller when it answers; otherwise rebuilt from the journal."""
    client = client_for(jobdir)
    if client.available():
        try:
            return client.call("status")["status"]
        except ApiError:
            pass
    import time

    from rlctl.controller.replay import replay_model
    from rlctl.core.snapshot import snapshot

    model = replay_model(jobdir)
    controller: dict[str, Any] = {"live": False}
    try:
        controller["stopped"] = jobdir.stop_note.read_text().strip()  # it could not write the job directory
    except OSError:
        pass
    return snapshot(model, time.time(), controller=controller)
