"""The per-job directory: where a job's journal, secret, sockets, logs and checkpoints live.

Layout (under ``<state_dir>/<job_id>/``): ``job.toml`` (the spec as launched), ``journal.db``
(SQLite WAL), ``secret`` (0600), ``controller.json`` (pid, agent port, API socket),
``controller.log``, ``api.sock`` (0600), ``nodes/<node>/`` (agent work dirs on the local
backend), ``checkpoints/``, ``agent/`` (the zipapp).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl_agent.config import unix_socket_path

DEFAULT_STATE_DIR = "~/.rlctl/jobs"


def state_root(configured: str | None = None) -> Path:
    """Where job directories live: $RLCTL_HOME, else the spec's ``job.state_dir``, else ~/.rlctl/jobs."""
    env = os.environ.get("RLCTL_HOME")
    return Path(os.path.expanduser(env or configured or DEFAULT_STATE_DIR)).resolve()


def new_job_id(name: str, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


@dataclass(frozen=True)
class JobDir:
    path: Path

    @property
    def job_id(self) -> str:
        return self.path.name

    @property
    def spec_file(self) -> Path:
        return self.path / "job.toml"

    @property
    def journal(self) -> Path:
        return self.path / "journal.db"

    @property
    def secret_file(self) -> Path:
        return self.path / "secret"

    @property
    def controller_file(self) -> Path:
        return self.path / "controller.json"

    @property
    def log_file(self) -> Path:
        return self.path / "controller.log"

    @property
    def api_socket(self) -> Path:
        """The controller's unix socket: ``api.sock`` in the job directory, or a short private path
        when that one is too long for a unix socket address."""
        return unix_socket_path(self.path / "api.sock", self.path.resolve(), prefix="api-")

    @property
    def stop_note(self) -> Path:
        """Why the controller stopped when it could not write the job directory (its disk full):
        outside the job directory, in the private per-user folder under /tmp, since the job's own
        disk may have no room for it."""
        return unix_socket_path(self.path / ("x" * 100), self.path.resolve(), prefix="stopped-").with_suffix(".txt")

    @property
    def spec_base_file(self) -> Path:
        """The folder the original job file was in: its relative paths are read from there."""
        return self.path / "job.base"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def node_dir(self, node: str) -> Path:
        return self.path / "nodes" / node

    def create(self, spec_text: str, spec_base_dir: Path | None = None) -> None:
        """Make the directory, copy the spec (and the folder its relative paths are read from),
        write a fresh 0600 secret. Fails if it exists."""
        self.path.mkdir(parents=True, exist_ok=False, mode=0o700)
        (self.path / "nodes").mkdir()
        self.checkpoints.mkdir()
        self.spec_file.write_text(spec_text)
        if spec_base_dir is not None:
            self.spec_base_file.write_text(str(spec_base_dir.resolve()) + "\n")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))

    def secret(self) -> bytes:
        return bytes.fromhex(self.secret_file.read_text().strip())

    def read_controller(self) -> dict[str, Any]:
        try:
            return json.loads(self.controller_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_controller(self, info: dict[str, Any]) -> None:
        tmp = self.controller_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, self.controller_file)


def launched_at_ns(jobdir: JobDir) -> int:
    """When the job was launched: its secret is written once, at launch (the directory's own mtime
    moves whenever a file is made in it, so with two jobs running it would reorder them)."""
    try:
        return jobdir.secret_file.stat().st_mtime_ns
    except OSError:
        return jobdir.path.stat().st_mtime_ns


def list_jobs(root: Path) -> list[JobDir]:
    """The jobs under ``root``, in launch order."""
    if not root.is_dir():
        return []
    return sorted((JobDir(p) for p in root.iterdir() if (p / "journal.db").exists()),
                  key=lambda j: (launched_at_ns(j), j.job_id))


def find_job(root: Path, job: str | None) -> JobDir:
    """The job named ``job`` (an id or a unique prefix), or the newest job when ``job`` is None."""
    jobs = list_jobs(root)
    if not jobs:
        raise LookupError(f"no jobs under {root}")
    if job is None:
        return jobs[-1]
    exact = [j for j in jobs if j.job_id == job]
    if exact:
        return exact[0]
    matches = [j for j in jobs if j.job_id.startswith(job)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise LookupError(f"no job {job!r} under {root}; known: {', '.join(j.job_id for j in jobs[-10:])}")
    raise LookupError(f"{job!r} matches several jobs: {', '.join(j.job_id for j in matches)}")
