"""`rlctl launch`: validate, plan, then start the job's controller (detached by default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.markup import escape

from rlctl.cli.common import STATE_DIR_OPTION, console, err_console, fail, print_json, resolve_job
from rlctl.cli.outdir import OutDirError, check_target, write_folder
from rlctl.controller.api import ApiClient, ApiError
from rlctl.controller.jobdir import JobDir, new_job_id, state_root
from rlctl.controller.predecessor import EXIT_FENCED
from rlctl.controller.store import Journal
from rlctl.core.event_payloads import ControllerStartedData
from rlctl.core.spec import JobSpec, SpecError

CONTROLLER_READY_TIMEOUT_S = 60.0
PLAN_FILE = "plan.json"  # beside the rendered scripts in ``launch --dry-run --out DIR``


def launch(
    job_file: Path = typer.Argument(..., help="The job spec (job.toml)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (and rendered sbatch scripts) without starting anything."),
    out: Path = typer.Option(None, "--out", help="With --dry-run: also write each rendered script and the plan "
                             "(plan.json) into this new or empty folder."),
    foreground: bool = typer.Option(False, "--foreground", help="Run the controller in this process (for debugging)."),
    watch: bool = typer.Option(False, "--watch", help="Follow the live status view after launching."),
    state_dir: str = typer.Option(None, "--state-dir", help="Where job directories live (default: job.state_dir or $RLCTL_HOME)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Validate JOB_FILE, plan roles onto nodes and start the job."""
    from rlctl.spec_loader import load_job_file

    if out is not None:
        if not dry_run:
            fail("--out writes what a dry run renders: use it with --dry-run", code=2)
        try:
            check_target(out, "--out")
        except OutDirError as exc:
            fail(str(exc), code=2)
    try:
        spec = load_job_file(job_file)
    except SpecError as exc:
        for problem in exc.problems:
            err_console.print(f"[bold red]error:[/] {escape(problem.render(exc.source))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    _check_observability(spec)
    checks = _preflight(spec)
    if dry_run:
        _dry_run(spec, checks, out, json_out)
        return
    ensure_model(spec)
    root = state_root(state_dir or spec.state_dir)
    root.mkdir(parents=True, exist_ok=True)
    jobdir = JobDir(root / new_job_id(spec.name))
    jobdir.create(job_file.read_text(), job_file.parent)
    if foreground:
        _run_foreground(jobdir, spec)
        return
    process = _spawn_controller(jobdir)
    _wait_ready(jobdir, process, allocated=True)
    if json_out:
        print_json({"job_id": jobdir.job_id, "job_dir": str(jobdir.path), "controller_pid": process.pid,
                    "backend": spec.backend, "nodes": spec.nodes_needed})
    else:
        console.print(f"launched [bold]{jobdir.job_id}[/] ({spec.backend} backend, {spec.nodes_needed} nodes)")
        console.print(f"  watch it:  rlctl status --watch {jobdir.job_id}")
        console.print(f"  stop it:   rlctl stop {jobdir.job_id}")
        console.print(f"  job dir:   {jobdir.path}")
        if spec.observability.prometheus_port:
            address = spec.observability.prometheus_address
            console.print(f"  metrics:   http://{address}:{spec.observability.prometheus_port}/metrics")
    if watch:
        from rlctl.cli.status import watch_status

        watch_status(jobdir, interval=0.5)


def ensure_model(spec: JobSpec) -> None:
    """A job that names no model trains the reference model: make it now (cached; about a minute
    the first time), before a controller starts."""
    if spec.hf_model:
        return
    from rlctl.workload.reference import ensure_reference_model, is_ready, reference_model_dir

    if is_ready(reference_model_dir(spec)):
        return
    with err_console.status("making the reference model (a tiny Llama, warm-started on the reference task; "
                            "first run only)"):
        ensure_reference_model(spec)


def _check_observability(spec: JobSpec) -> None:
    """``[observability]`` settings that cannot work (a taken port, a read-only directory, a
    missing package or login) exit 2 naming the key, nothing started."""
    from rlctl.observe.checks import observability_problems

    problems = observability_problems(spec.observability)
    for problem in problems:
        err_console.print(f"[bold red]error:[/] {escape(problem.render(spec.source))}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)


def _preflight(spec: JobSpec) -> dict[str, object]:
    """The workload's checks (model folder, data rows, reward import, environment class) before
    anything starts; a problem exits 2 with every message, nothing started."""
    if not spec.hf_model and not spec.multi_turn:
        return {}
    from rlctl.workload.prompts import PreflightError, preflight

    with err_console.status("checking the model folder, the data, the reward function and the environment"):
        try:
            return preflight(spec)
        except PreflightError as exc:
            for problem in exc.problems:
                err_console.print(f"[bold red]error:[/] {escape(f'{spec.source}: {problem}')}", highlight=False,
                                  soft_wrap=True)
            raise typer.Exit(2) from None


def _workload_lines(checks: dict[str, object]) -> list[str]:
    lines = []
    model = checks.get("model")
    if isinstance(model, dict):
        lines.append(f"model: {model['path']} ({model['model_type']}, vocab {model['vocab_size']}, "
                     f"{len(model['weights'])} weight file(s))")
        lines.append(f"weights: {model['weights_check']}")
    for key in ("train_files", "eval_files"):
        facts = checks.get(key)
        if isinstance(facts, dict):
            fate = "truncated" if facts.get("truncated") else "left out"
            lines.append(f"data {key}: {facts['prompts']} prompts ({facts['too_long']} longer than max_prompt_tokens, "
                         f"{fate})")
    if "reward" in checks:
        lines.append(f"reward: {checks['reward']}")
    if "env" in checks:
        lines.append(f"env: {checks['env']}")
    sizing = checks.get("sizing")
    if isinstance(sizing, dict):
        lines.extend(str(line) for line in sizing["lines"])
    return lines


def _dry_run(spec: JobSpec, checks: dict[str, object], out: Path | None, json_out: bool) -> None:
    """Print the plan and the backend's rendering (the sbatch scripts) verbatim; with ``out``, also
    write each rendered script and ``plan.json`` into that folder, whole or not at all."""
    from rlctl.backends.plans import render_launch

    rendering = render_launch(spec)
    plan = "\n".join([*_plan_lines(spec, rendering.plan_lines, checks), rendering.backend_text])
    summary: dict[str, object] = {"job": spec.name, "backend": spec.backend, "nodes": spec.nodes_needed, "plan": plan,
                                  "checks": checks}
    if out is not None:
        files = {**rendering.files, PLAN_FILE: json.dumps({**summary, "files": sorted(rendering.files)}, indent=1,
                                                          default=str) + "\n"}
        try:
            written = write_folder(out, files, "--out")
        except OutDirError as exc:
            fail(str(exc), code=2)
        summary.update(out=str(out), files=[path.name for path in written])
    if json_out:
        print_json(summary)
        return
    _print_verbatim(plan)
    if out is not None:
        err_console.print(f"wrote {', '.join(files)} to {out}", highlight=False, markup=False, soft_wrap=True)


def _print_verbatim(text: str) -> None:
    """File content exactly as rendered: no wrapping at the terminal's (or $COLUMNS') width, no
    markup, highlighting or tab expansion, piped or not."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def _plan_lines(spec: JobSpec, plan_lines: list[str], checks: dict[str, object]) -> list[str]:
    return [
        *plan_lines,
        (f"rollout: batch {spec.rollout.batch_prompts} prompts x {spec.rollout.group_size} samples, "
         f"tail batching {'on' if spec.rollout.tail_batching.enabled else 'off'}"),
        *_workload_lines(checks),
    ]


def checkpoints_to_reject(job_id: str, job: str, folders: dict[int, Path], from_checkpoint: int | None) -> dict[int, str]:
    """What a resume tells the controller never to restore from: nothing when the newest checkpoint
    verifies; with ``--from-checkpoint`` every newer one (each with why). A corrupt newest one without
    ``--from-checkpoint``, or a ``--from-checkpoint`` that is not a valid checkpoint, fails naming it."""
    from rlctl.workload.checkpoint_manifest import CheckpointCorruptError, newest_valid, verify_checkpoint

    if from_checkpoint is None:
        if not folders:
            return {}
        newest = max(folders)
        try:
            verify_checkpoint(folders[newest])
        except CheckpointCorruptError as corrupt:
            fallback = newest_valid(folders, below=newest).step
            use = (f"; the newest valid checkpoint is step {fallback}: `rlctl resume {job} --from-checkpoint "
                   f"{fallback}` goes on from it (the steps since are trained again from the kept batches)"
                   if fallback is not None else "; no checkpoint before it is valid either")
            fail(f"{job_id}: the newest checkpoint (step {newest}) is corrupt: {corrupt}{use}", 2)
        return {}
    if from_checkpoint not in folders:
        fail(f"--from-checkpoint: {job_id} has no usable checkpoint of step {from_checkpoint} "
             f"(steps: {', '.join(map(str, sorted(folders))) or 'none'})", 2)
    try:
        verify_checkpoint(folders[from_checkpoint])
    except CheckpointCorruptError as corrupt:
        fail(f"--from-checkpoint: the checkpoint of step {from_checkpoint} is corrupt too: {corrupt}", 2)
    return {step: f"(folder): passed over by `rlctl resume --from-checkpoint {from_checkpoint}`"
            for step in folders if step > from_checkpoint}


def _spawn_controller(jobdir: JobDir, resume: bool = False, expect_epoch: int | None = None,
                      rejections: dict[int, str] | None = None) -> subprocess.Popen[bytes]:
    """The job's controller as a detached process (its output appended to ``controller.out``). A
    resumed one is told the controller epoch the job was read at (``expect_epoch``) and the
    checkpoints it must never restore from (``rejections``: step -> why)."""
    resuming = ["--resume", *(["--expect-epoch", str(expect_epoch)] if expect_epoch is not None else [])] if resume else []
    if rejections:
        resuming += ["--reject-checkpoints", json.dumps({str(step): why for step, why in rejections.items()})]
    with open(jobdir.path / "controller.out", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rlctl.controller_process", "--job-dir", str(jobdir.path), *resuming],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=str(jobdir.path), env=dict(os.environ),
        )


def _wait_ready(jobdir: JobDir, process: subprocess.Popen[bytes], allocated: bool = False, resumed: bool = False) -> None:
    """Until the controller answers (with ``allocated``: and every node has its agent, so a backend's refusal
    is reported here, as one message). A slow allocation (a queued Slurm job) is left to run after
    ``CONTROLLER_READY_TIMEOUT_S``: the job is launched, and ``rlctl status`` follows it. ``resumed``:
    only ``process`` answering counts (another resume's controller may answer on the same socket), and
    ``process`` exiting fenced means that other one took the job."""
    deadline = time.monotonic() + CONTROLLER_READY_TIMEOUT_S
    client = ApiClient(jobdir.api_socket, timeout_s=2.0)
    answered = False
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if resumed and process.returncode == EXIT_FENCED:
                fail(_taken_over(jobdir), code=EXIT_FENCED)
            fail(_why_it_ended(jobdir, process.returncode))
        if client.available():
            try:
                snap = client.call("status")["status"]
            except ApiError:
                snap = None
            if snap is not None and resumed and snap["controller"].get("pid") != process.pid:
                snap = None
            if snap is not None:
                answered = True
                state = snap["job"]["state"]
                if state == "failed":  # journaled before the process is gone: its reason is the message
                    _wait_exit(process)
                    fail(_why_it_ended(jobdir, process.returncode))
                if not allocated or state not in ("pending", "starting") or _agents_up(snap):
                    return
        time.sleep(0.1)
    if answered:
        return
    fail(f"the controller did not answer within {CONTROLLER_READY_TIMEOUT_S:.0f}s; see {jobdir.log_file}")


def _taken_over(jobdir: JobDir) -> str:
    """What a resume whose controller was fenced at its start says: another controller runs the job
    (the newest start in the journal; its ``controller.json`` may not be written yet)."""
    journal = Journal(jobdir.journal, readonly=True)
    try:
        starts = list(journal.read(types=("ControllerStarted",)))
    finally:
        journal.close()
    newest = starts[-1].as_(ControllerStartedData) if starts else None
    by = f" (controller pid {newest.pid}, epoch {newest.epoch})" if newest is not None else ""
    return (f"{jobdir.job_id} was taken over by another controller{by} while this resume started; this "
            "resume did nothing, the other controller runs the job")


def _agents_up(snap: dict[str, object]) -> bool:
    """Every node has its agent: a backend that hands out nodes at once (an SSH inventory) refuses
    only when their agents start, which is what launch waits to report. A node that failed to start
    is not up: the controller either replaces it (and the job goes on to run) or fails the job."""
    nodes = snap["nodes"]
    return isinstance(nodes, list) and bool(nodes) and all(
        n["state"] not in ("allocating", "starting", "failed") for n in nodes)


def _wait_exit(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Give a controller that journaled its failure the time to release its nodes and exit."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _why_it_ended(jobdir: JobDir, code: int | None) -> str:
    """One message for a controller that exited before it was ready: the reason it journaled (a
    backend's refusal names the key to change), else the last line it printed. The traceback, if
    any, stays in controller.log."""
    reason = ""
    if jobdir.journal.exists():
        from rlctl.controller.replay import replay_model

        life = replay_model(jobdir).life
        if life.state.terminal and life.history:
            reason = life.history[-1].reason
    if not reason:
        printed = [line for line in _tail(jobdir.path / "controller.out").splitlines() if line.strip()]
        reason = printed[-1] if printed else f"the controller exited with code {code}"
    return f"{jobdir.job_id} did not start: {reason}\n  details: {jobdir.log_file}"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except FileNotFoundError:
        return ""


def _run_foreground(jobdir: JobDir, spec: JobSpec) -> None:
    import asyncio

    from rlctl.assembly import make_backend as build
    from rlctl.assembly import make_workload
    from rlctl.controller.server import Controller, setup_logging

    setup_logging(jobdir.log_file)
    console.print(f"running [bold]{jobdir.job_id}[/] in the foreground (log: {jobdir.log_file})")
    code = asyncio.run(Controller(jobdir, spec, build(spec, jobdir), make_workload(spec)).run())
    raise typer.Exit(code)


def resume(job: str = typer.Argument(..., help="Job id or unique prefix."), json_out: bool = typer.Option(False, "--json"),
           from_checkpoint: int = typer.Option(None, "--from-checkpoint", metavar="STEP",
                                               help="Restore a trainer from this checkpoint and not from the newer "
                                                    "ones (the way past a corrupt newest checkpoint)."),
           state_dir: str = STATE_DIR_OPTION) -> None:
    """Start a job's controller again after it died; it rebuilds its state from the journal. A job
    that has ended is not resumed (nothing is written to it). A newest checkpoint that does not match
    its checksums is refused by name, with the valid step ``--from-checkpoint`` could use."""
    from rlctl.controller.replay import replay_model
    from rlctl.spec_loader import load_job_dir_spec

    jobdir = resolve_job(job, state_dir)
    if not jobdir.journal.exists():
        fail(f"{jobdir.job_id} has no journal ({jobdir.journal}); it never started, so there is nothing to resume")
    model = replay_model(jobdir)
    if model.life.state.terminal:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(model.life.since))
        reason = model.life.history[-1].reason if model.life.history else ""
        if json_out:
            print_json({"job_id": jobdir.job_id, "resumed": False, "state": model.life.state.value,
                        "step": model.step, "ended_at": model.life.since, "reason": reason})
        fail(f"{jobdir.job_id} has ended ({model.life.state.value} at step {model.step}/{model.total_steps}, "
             f"{ended}: {reason}); there is nothing to resume. Launch it again to train anew.")
    rejections = checkpoints_to_reject(jobdir.job_id, job, {s: Path(p) for s, p in model.checkpoints.items()
                                                             if s not in model.rejected_checkpoints}, from_checkpoint)
    ensure_model(load_job_dir_spec(jobdir))
    client = ApiClient(jobdir.api_socket, timeout_s=3.0)
    if client.available():
        try:
            client.call("status")
            fail(f"{jobdir.job_id} already has a running controller")
        except ApiError:
            pass  # a dead controller, or one that does not answer (paused, hung): the new one fences it
    process = _spawn_controller(jobdir, resume=True, expect_epoch=model.controller_epoch, rejections=rejections)
    _wait_ready(jobdir, process, resumed=True)
    if json_out:
        print_json({"job_id": jobdir.job_id, "resumed": True, "controller_pid": process.pid})
    else:
        console.print(f"resumed {jobdir.job_id} (controller pid {process.pid})")
