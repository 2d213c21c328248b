"""The Slurm client commands a job's controller runs (sbatch, squeue, scontrol, scancel) and their
output parsers.

Role: what ``SlurmBackend`` asks Slurm through, on the controller's machine: every command with
the job's ``SLURM_CONF`` and a timeout, a failure raised as a ``BackendError`` that names the
command. The parsers read Slurm 22.05's output (newer schemas are accepted too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlctl.backends.base import BackendError
from rlctl.backends.slurm_states import JobVerdict, map_job_state

log = logging.getLogger(__name__)

DEFAULT_SLURMD_PORT = 6818


@dataclass(frozen=True)
class SlurmTask:
    """One array task as seen in ``squeue --json``."""

    job_id: str
    array_job_id: str
    array_task_id: int | None
    name: str
    state: str
    nodes: str
    reason: str
    exit_code: int | None


def parse_squeue_json(text: str) -> list[SlurmTask]:
    """The jobs in ``squeue --json`` output (Slurm 22.05 schema; newer ones are accepted too)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BackendError(f"squeue --json printed invalid JSON: {exc}") from exc
    tasks = []
    for job in data.get("jobs", []):
        state = job.get("job_state", "")
        if isinstance(state, list):  # 23.02+: a list of flags
            state = state[0] if state else ""
        task_id = job.get("array_task_id")
        if isinstance(task_id, dict):  # 23.02+: {"set": bool, "number": int}
            task_id = task_id.get("number") if task_id.get("set") else None
        exit_code = job.get("exit_code")
        if isinstance(exit_code, dict):
            exit_code = (exit_code.get("return_code") or {}).get("number") if isinstance(
                exit_code.get("return_code"), dict) else exit_code.get("return_code")
        tasks.append(SlurmTask(
            job_id=str(job.get("job_id")),
            array_job_id=str(job.get("array_job_id") or job.get("job_id")),
            array_task_id=int(task_id) if isinstance(task_id, int) else None,
            name=str(job.get("name", "")),
            state=str(state),
            nodes=str(job.get("nodes", "") or ""),
            reason=str(job.get("state_reason", "") or ""),
            exit_code=exit_code if isinstance(exit_code, int) else None,
        ))
    return tasks


_KV_SPLIT = re.compile(r"\s+(?=[A-Za-z][\w/:]*=)")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol show node|job -o`` line as a dict (values may contain spaces, e.g. Reason)."""
    out: dict[str, str] = {}
    for token in _KV_SPLIT.split(line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """``ExitCode=2:0`` -> (2, 0)."""
    code, _, sig = text.partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, None


class SlurmCommands:
    """Slurm's client commands, bounded by ``command_timeout_s``, with ``slurm_conf`` when given."""

    def __init__(self, slurm_conf: Path | None, command_timeout_s: float) -> None:
        self.slurm_conf = slurm_conf
        self.command_timeout_s = command_timeout_s
        self._slurmd_port: int | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    async def run(self, *argv: str, check: bool = True) -> str:
        """Run a Slurm client command; raise BackendError naming it on failure or timeout."""
        if shutil.which(argv[0]) is None:
            raise BackendError(f"{argv[0]} not found on PATH (is slurm-client installed?)")
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self.env(),
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.command_timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(f"`{' '.join(argv)}` timed out after {self.command_timeout_s:.0f}s") from None
        if check and proc.returncode != 0:
            raise BackendError(f"`{' '.join(argv)}` exited {proc.returncode}: {err.decode(errors='replace').strip()}")
        return out.decode(errors="replace")

    async def squeue(self) -> list[SlurmTask]:
        """Every job slurmctld knows about (``squeue --json``; filters are ignored by 22.05 --json)."""
        return parse_squeue_json(await self.run("squeue", "--json"))

    async def show_node(self, node: str) -> dict[str, str]:
        out = await self.run("scontrol", "show", "node", "-o", node)
        return parse_scontrol_record(out.splitlines()[0] if out.strip() else "")

    async def show_job(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job -o`` of one job, None once slurmctld forgot it (MinJobAge)."""
        out = await self.run("scontrol", "show", "job", "-o", job_id, check=False)
        line = out.splitlines()[0] if out.strip() else ""
        return parse_scontrol_record(line) if line.startswith("JobId=") else None

    async def job_verdict(self, job_id: str) -> JobVerdict:
        """A job's state in rlctl terms (CANCELLED-like UNKNOWN when slurmctld forgot it)."""
        rec = await self.show_job(job_id)
        if rec is None:
            return map_job_state("UNKNOWN")
        code, sig = parse_exit_code(rec.get("ExitCode", ""))
        return map_job_state(rec.get("JobState", "UNKNOWN"), code, sig)

    async def slurmd_port(self) -> int:
        """``SlurmdPort`` from ``scontrol show config`` (cached; 6818 when it cannot be read)."""
        if self._slurmd_port is None:
            try:
                out = await self.run("scontrol", "show", "config")
            except BackendError as exc:
                log.warning("reading SlurmdPort failed (%s); assuming %d", exc, DEFAULT_SLURMD_PORT)
                return DEFAULT_SLURMD_PORT
            match = re.search(r"^SlurmdPort\s*=\s*(\d+)", out, re.MULTILINE)
            self._slurmd_port = int(match.group(1)) if match else DEFAULT_SLURMD_PORT
        return self._slurmd_port

    async def scancel(self, job_ids: list[str]) -> None:
        if job_ids:
            await self.run("scancel", *job_ids, check=False)
