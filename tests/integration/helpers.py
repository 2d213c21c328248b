"""Helpers for integration tests that run real jobs (controller, agents, workers) on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlctl.lab.reference_jobs import slow_reward_table, write_job  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[2]

def env_for(state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["RLCTL_HOME"] = str(state_dir)
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    env.update(UCX_NET_DEVICES="lo", UCXPY_PROGRESS_MODE="blocking", UCX_WARN_UNUSED_ENV_VARS="n")
    return env


def rlctl(state_dir: Path, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "rlctl.cli", *args], env=env_for(state_dir), capture_output=True,
                            text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"rlctl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def rlctl_json(state_dir: Path, *args: str) -> Any:
    return json.loads(rlctl(state_dir, *args, "--json").stdout.strip().splitlines()[-1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def status(state_dir: Path, job: str) -> dict[str, Any]:
    return rlctl_json(state_dir, "status", job)


def wait_recovered(state_dir: Path, job: str, fault_ids: list[str], min_step: int, timeout: float,
                   what: str) -> dict[str, Any]:
    """The job's status once every fault in ``fault_ids`` is recovered and it reached ``min_step``."""
    def done() -> dict[str, Any] | None:
        snap = status(state_dir, job)
        faults = {f["fault_id"]: f for f in snap["faults"]}
        recovered = all(faults.get(i, {}).get("recovered_at") for i in fault_ids)
        return snap if recovered and snap["job"]["step"] >= min_step else None

    return wait_for(done, timeout, what)


def print_figures(probe: str, **figures: Any) -> None:
    """One ``FIGURES {...}`` line for docs/reliability.md (shown with ``pytest -s``)."""
    print("FIGURES " + json.dumps({"probe": probe, **figures}, sort_keys=True), flush=True)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a reaped process does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def processes_under(path: Path) -> list[int]:
    """PIDs whose working directory or command line is inside ``path`` (what a job leaves behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except (OSError, ValueError):
            continue
        if state == "Z":
            continue
        if str(path) in cmdline or cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def kill_everything_under(path: Path) -> None:
    for pid in processes_under(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_to_end(state_dir: Path, job_file: Path, timeout: float) -> tuple[dict[str, Any], list[Any]]:
    """Launch ``job_file``, wait until the job ends, and return its final status and its journal's
    events; the job is stopped and every process under ``job_file``'s folder killed either way."""
    from rlctl.controller.jobdir import JobDir
    from rlctl.controller.store import Journal

    launched = rlctl_json(state_dir, "launch", str(job_file))
    job_id = launched["job_id"]
    try:
        wait_for(lambda: status(state_dir, job_id)["job"]["state"] in ("succeeded", "failed", "stopped"), timeout,
                 f"job {job_id} to end")
        return status(state_dir, job_id), list(Journal(JobDir(Path(launched["job_dir"])).journal, readonly=True).read())
    finally:
        rlctl(state_dir, "stop", job_id, check=False)
        kill_everything_under(job_file.parent)
