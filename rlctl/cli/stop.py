"""`rlctl stop`: stop a job, keeping what the trainer trained since its last checkpoint.

The live controller is asked to stop; unless ``--now``, it first has the trainer checkpoint the
version it holds (bounded by ``--timeout`` or the job's ``[job] stop_checkpoint_timeout_s``), and
this command shows that wait and then what was saved, from the journal's ``StopCheckpoint``
event. With no live controller the job is stopped through its backend, and the command says what
could not be saved. Progress goes to stderr, so ``--json`` output stays one object on stdout.
"""

from __future__ import annotations

import time
from typing import Any

import typer

from rlctl.cli.common import (
    STATE_DIR_OPTION,
    client_for,
    console,
    err_console,
    fail,
    job_status,
    print_json,
    resolve_job_to_act_on,
)
from rlctl.controller.api import STOP_TIMEOUT_RANGE_S, ApiClient, ApiError
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import EventKind
from rlctl.core.states import ENDED_JOB_STATES
from rlctl.core.stopsave import describe

RELEASE_WAIT_S = 120.0  # after the stop checkpoint: workers stopped, agents shut down, nodes released
PLAIN_PROGRESS_EVERY_S = 10.0  # a progress line this often when stderr is not a terminal


def stop(
    job: str = typer.Argument(..., help="Job id or unique prefix."),
    now: bool = typer.Option(False, "--now", help="Stop at once: no checkpoint of the steps trained since the last one "
                             "(also cuts short a stop checkpoint under way)."),
    timeout: float = typer.Option(None, "--timeout", help="Seconds to wait for the trainer's stop checkpoint "
                                  "(default: the job file's stop_checkpoint_timeout_s, 300 unless set)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the checkpoint is written and every node is released."),
    json_out: bool = typer.Option(False, "--json"),
    state_dir: str = STATE_DIR_OPTION,
) -> None:
    """Stop a job: the trainer checkpoints the version it holds, then workers are stopped, agents shut
    down, nodes released. Nothing the job produced is deleted. With no live controller, the job is
    stopped through its backend and the stop is journaled."""
    if timeout is not None:
        low, high = STOP_TIMEOUT_RANGE_S
        if now:
            fail("--timeout: --now writes no checkpoint, so there is nothing to wait for; give one or the other", 2)
        if not low <= timeout <= high:
            fail(f"--timeout: expected seconds in [{low:g}, {high:g}], got {timeout:g}", 2)
    jobdir = resolve_job_to_act_on(job, state_dir, "stop")
    client = client_for(jobdir)
    fields: dict[str, Any] = {"reason": "stopped by the operator" + (" (--now)" if now else ""), "checkpoint": not now}
    if timeout is not None:
        fields["timeout_s"] = timeout
    watch = StopCheckpointWatch(jobdir)
    watch.look()
    try:
        answer = client.call("stop", **fields)["stop"]
    except ApiError as exc:
        snap = job_status(jobdir)["job"]
        if snap["state"] in ENDED_JOB_STATES:
            _already_ended(jobdir, snap, now, json_out)
            return
        _stop_offline(jobdir, str(exc), json_out)
        return
    if not answer["already"]:
        watch.found = None  # a stop checkpoint journaled before (a stop the job was resumed from) is not this one's
    if answer["already"] and answer["state"] in ENDED_JOB_STATES:
        _already_ended(jobdir, job_status(jobdir)["job"], now, json_out)
        return
    if answer["already"] and now and not answer["saving"]:
        fail(f"--now: {jobdir.job_id} is already stopping and no stop checkpoint is under way to skip", 2)
    plan = answer.get("plan") or {}
    if not wait:
        if json_out:
            print_json({"job_id": jobdir.job_id, "state": "stopping", "plan": plan})
        else:
            console.print(f"{jobdir.job_id}: stopping; {plan.get('reason') or 'no stop checkpoint'}", highlight=False, markup=False)
        return
    if plan.get("wait") and not now:
        _show_stop_checkpoint(watch, client, plan, quiet=json_out)
    deadline = time.monotonic() + RELEASE_WAIT_S
    while time.monotonic() < deadline and client.available():
        time.sleep(0.2)
    _report(jobdir, watch, job_status(jobdir)["job"], json_out)


def _already_ended(jobdir: JobDir, snap: dict[str, Any], now: bool, json_out: bool) -> None:
    if now:
        fail(f"--now: {jobdir.job_id} is not running (it {snap['state']} at step {snap['step']}); there is nothing "
             "to stop", 2)
    if json_out:
        print_json({"job_id": jobdir.job_id, "state": snap["state"], "already_ended": True, "step": snap["step"],
                    "checkpoint_step": snap["checkpoint_step"]})
    else:
        console.print(f"{jobdir.job_id} already ended ({snap['state']})")


class StopCheckpointWatch:
    """The journal's newest ``StopCheckpoint`` event, read incrementally (a long job's journal is
    large; each look reads only the events since the last)."""

    def __init__(self, jobdir: JobDir) -> None:
        self.jobdir = jobdir
        self.seen_seq = 0
        self.found: dict[str, Any] | None = None

    def look(self) -> dict[str, Any] | None:
        journal = Journal(self.jobdir.journal, readonly=True)
        try:
            newest = journal.last_seq()
            for ev in journal.read(after_seq=self.seen_seq, types=(EventKind.STOP_CHECKPOINT.value,)):
                self.found = ev.data
            self.seen_seq = newest
        finally:
            journal.close()
        return self.found


def _show_stop_checkpoint(watch: StopCheckpointWatch, client: ApiClient, plan: dict[str, Any], quiet: bool) -> None:
    """Wait for the stop checkpoint to end, showing the trainer's phase and the time against the
    timeout (a live line on a terminal; a line every ``PLAIN_PROGRESS_EVERY_S`` otherwise)."""
    timeout_s = float(plan["timeout_s"])
    began = time.monotonic()
    deadline = began + timeout_s + 30.0  # the controller ends the wait at its own timeout

    def progress() -> str:
        try:
            snap = client.call("status")["status"]
        except ApiError:
            return f"saving before stopping: {time.monotonic() - began:.0f} s of {timeout_s:g} s"
        phases: list[str] = next((r["phases"] for r in snap["roles"] if r["role"] == "trainer"), [])
        return (f"saving before stopping: the trainer is {'/'.join(phases) or 'gone'} at step "
                f"{snap['job']['weights_version']} (last checkpoint: step {snap['job']['checkpoint_step']}), "
                f"{time.monotonic() - began:.0f} s of {timeout_s:g} s")

    def ended() -> bool:
        return watch.look() is not None or not client.available() or time.monotonic() > deadline

    if quiet:
        while not ended():
            time.sleep(0.2)
        return
    if err_console.is_terminal:
        with err_console.status(progress()) as shown:
            while not ended():
                time.sleep(0.5)
                shown.update(progress())
        return
    err_console.print(progress(), highlight=False, soft_wrap=True)
    last = time.monotonic()
    while not ended():
        time.sleep(0.2)
        if time.monotonic() - last >= PLAIN_PROGRESS_EVERY_S:
            err_console.print(progress(), highlight=False, soft_wrap=True)
            last = time.monotonic()


def _report(jobdir: JobDir, watch: StopCheckpointWatch, snap: dict[str, Any], json_out: bool) -> None:
    saved = watch.look()
    if json_out:
        print_json({"job_id": jobdir.job_id, "state": snap["state"], "step": snap["step"],
                    "checkpoint_step": snap["checkpoint_step"], "checkpoint": saved})
        return
    if saved is not None:
        console.print(f"{jobdir.job_id}: {describe(saved)}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"{jobdir.job_id}: {snap['state']} at step {snap['step']}", highlight=False)


def _stop_offline(jobdir: JobDir, why: str, json_out: bool) -> None:
    """No controller answers: stop the job through its backend (which also fences a paused one)."""
    import asyncio

    from rlctl.assembly import make_backend
    from rlctl.controller.offline import OfflineStopError, stop_offline
    from rlctl.core.spec import SpecError
    from rlctl.spec_loader import load_job_dir_spec

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
                    "nodes_released": result.nodes_released, "workers_stopped": result.workers_stopped,
                    "checkpoint": result.checkpoint})
        return
    if result.checkpoint is not None:
        console.print(f"{jobdir.job_id}: {describe(result.checkpoint)}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"{jobdir.job_id}: {result.state} at step {result.step} ({result.nodes_released} node(s) "
                  f"released through the backend, {result.workers_stopped} worker(s) stopped)")
