"""Worker supervision: start, signal, poll and re-adopt the role processes on this node.

Each worker runs in its own session (``start_new_session=True``) so signals go to its whole
process group, with stdout and stderr appended to ``workdir/logs/<wid>.log``. The worker table
is persisted in ``workdir/agent-state.json`` (wid, slot, role, pid, kernel start time, log
offset); a restarted agent re-adopts the workers that are still alive, telling them from a
reused PID by the start time in ``/proc/<pid>/stat``. Adopted workers are not children of the
agent, so their end is seen by polling ``/proc`` and reported with reason ``untracked-exit``.

A start asked to fork from the host's worker template (``template_client``) gets a worker forked
from a warm interpreter when one is ready, and a plain spawn otherwise. A forked worker is the
template's child; the template reports its end to this agent, so both kinds are supervised the
same way (exit code or killing signal, log, phases, signals to its process group).

Not thread-safe: the agent calls it from its event loop only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import protocol
from .config import AgentConfig
from .nccl import WorkerLogWatcher
from .template_client import ForkedChild, Template, WorkerTemplates, forkable

log = logging.getLogger("rlctl_agent.supervisor")

STATE_VERSION = 1


def _placed_gpus(env: dict[str, str]) -> list[int]:
    """The local GPU indices the controller placed a worker on (``RLCTL_GPUS``), [] if none."""
    return [int(part) for part in str(env.get(protocol.GPUS_ENV, "")).split(",") if part.strip().isdigit()]


def visible_devices(placed: list[int], node_visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker on the node's GPUs ``placed``: the entries of the
    node's own list (a Slurm step's, say) at those positions, else the indices themselves."""
    own = [part.strip() for part in (node_visible or "").split(",") if part.strip()]
    return ",".join(own[index] if index < len(own) else str(index) for index in placed)


class ChildProcess(Protocol):
    """A worker this agent can reap: a ``subprocess.Popen`` or a ``ForkedChild``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class SupervisorError(Exception):
    """A worker cannot be started or signalled (unknown wid, bad argv, missing cwd...)."""


@dataclass
class WorkerRecord:
    """One worker process and what the agent knows about it."""

    wid: str
    slot: str
    role: str
    pid: int
    start_time: int
    log_path: Path
    watcher: WorkerLogWatcher
    popen: ChildProcess | None = None
    phase: str = "starting"
    step: int | None = None
    progress: Any = None
    progress_changed_at: float = field(default_factory=time.monotonic)
    gpu: int | None = None
    suspended: bool = False
    exited: bool = False
    log_start: int = 0  # where this worker's own lines begin in its log (a wid's log may hold an earlier start's)
    forked: bool = False  # forked from the host's worker template (not spawned)

    @property
    def adopted(self) -> bool:
        """True when a previous agent started it (so it is not this process's child)."""
        return self.popen is None

    def heartbeat_entry(self, now: float) -> dict[str, Any]:
        """The worker's entry in ``heartbeat.workers`` and ``hello.facts.workers``."""
        return {
            "wid": self.wid, "slot": self.slot, "role": self.role, "pid": self.pid, "phase": self.phase,
            "step": self.step, "progress": self.progress,
            "progress_age_s": round(now - self.progress_changed_at, 3),
            "alive": not self.exited, "suspended": self.suspended, "adopted": self.adopted, "gpu": self.gpu,
            "forked": self.forked,
        }

    def state_entry(self) -> dict[str, Any]:
        return {"wid": self.wid, "slot": self.slot, "role": self.role, "pid": self.pid,
                "start_time": self.start_time, "log_path": str(self.log_path), "log_offset": self.watcher.offset,
                "log_start": self.log_start,
                "phase": self.phase, "step": self.step, "progress": self.progress, "gpu": self.gpu}


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended: ``worker_exited`` fields. ``error``: the last error it logged ("" if none)."""

    wid: str
    exit_code: int | None
    signal: str | None
    reason: str
    error: str = ""

    def message_fields(self) -> dict[str, Any]:
        return {"wid": self.wid, "exit_code": self.exit_code, "signal": self.signal, "reason": self.reason,
                "error": self.error}


LOG_TAIL_BYTES = 8192
ERROR_CHARS = 300


def last_error(log_path: Path, since: int = 0) -> str:
    """The last error a worker wrote to its log after byte ``since``: a Python traceback's final line
    (``SafetensorError: header too large``) where the tail holds one, else the last line that says
    error or fatal; "" when there is none (a worker killed by a signal mid-work usually logged none)."""
    try:
        with log_path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(since, size - LOG_TAIL_BYTES)
            handle.seek(start)
            tail = handle.read(size - start).decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        after = lines[max(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")):]
        final = [line for line in after if not line.startswith(("File ", "Traceback", "^", "~"))]
        if final:
            return final[-1][:ERROR_CHARS]
    flagged = [line for line in lines if any(word in line.lower() for word in ("error", "fatal"))]
    return flagged[-1][:ERROR_CHARS] if flagged else ""


# Deaths by signal whose cause the signal says better than the log: a worker killed by SIGBUS touched
# a page of a file it had mapped that no longer exists (the model's or a checkpoint's weights,
# truncated or rewritten in place instead of being replaced by a rename).
SIGNAL_CAUSES: dict[int, str] = {
    int(signal.SIGBUS): "SIGBUS: a file it had mapped (the model's or a checkpoint's weights) was truncated or "
                   "rewritten in place under it",
}


def signal_error(signum: int, logged: str) -> str:
    """What a worker killed by ``signum`` is reported to have failed with: the signal's cause where it
    has one (with what the worker logged after it), else what it logged."""
    cause = SIGNAL_CAUSES.get(signum)
    if cause is None:
        return logged
    return f"{cause} ({logged})"[:ERROR_CHARS] if logged else cause


def read_proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """True when ``pid`` is still the process that started at ``start_time`` and is not a zombie."""
    stat = read_proc_stat(pid)
    return stat is not None and stat[1] == start_time and stat[0] not in ("Z", "X")


def signal_name(signum: int) -> str:
    """SIGKILL for 9, and so on; the number as text when it has no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def parse_signal(value: Any) -> signal.Signals:
    """A signal from a name ("SIGTERM", "TERM") or a number."""
    try:
        if isinstance(value, int):
            return signal.Signals(value)
        name = str(value).upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise SupervisorError(f"unknown signal {value!r}") from None


class Supervisor:
    """The worker table of one node: start, signal, poll for exits, persist, re-adopt."""

    def __init__(self, config: AgentConfig, gpu_count: int = 0) -> None:
        self._config = config
        self._gpu_count = gpu_count
        self.workers: dict[str, WorkerRecord] = {}
        self.templates = WorkerTemplates(config.logs_dir, config.job_id)
        self._state_unwritable = False

    def live(self) -> list[WorkerRecord]:
        """Workers that have not been seen to exit."""
        return [record for record in self.workers.values() if not record.exited]

    def get(self, wid: str) -> WorkerRecord:
        record = self.workers.get(wid)
        if record is None:
            raise SupervisorError(f"no worker {wid!r} on this node")
        return record

    def start(self, wid: str, slot: str, role: str, argv: list[str], env: dict[str, str],
              cwd: str | None, template: bool = False) -> tuple[WorkerRecord, bool]:
        """Start worker ``wid``; idempotent: a known wid returns its record and False. ``template``:
        fork it from the host's worker template where one is ready (else spawn it)."""
        if wid in self.workers:
            return self.workers[wid], False
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise SupervisorError("argv must be a non-empty list of strings")
        workdir = Path(cwd) if cwd else self._config.workdir
        if not workdir.is_dir():
            raise SupervisorError(f"cwd {workdir} does not exist")
        self._config.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._config.logs_dir / f"{_safe_name(wid)}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        placed = _placed_gpus(env)
        worker_env = self._worker_env(wid, slot, role, env, placed)
        forked = self._fork(argv, worker_env, workdir, log_path) if template else None
        child: ChildProcess = forked if forked is not None else self._spawn(argv, worker_env, workdir, log_path)
        stat = read_proc_stat(child.pid)
        record = WorkerRecord(wid=wid, slot=slot, role=role, pid=child.pid, start_time=stat[1] if stat else 0,
                              log_path=log_path, watcher=WorkerLogWatcher(wid, log_path, offset), popen=child,
                              gpu=placed[0] if placed else self._pick_gpu(env), log_start=offset,
                              forked=forked is not None)
        self.workers[wid] = record
        self.save_state()
        log.info("started worker %s (role %s, slot %s) pid %d%s", wid, role, slot, child.pid,
                 " forked from the template" if record.forked else "")
        return record, True

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], workdir: Path, log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log_file:
            try:
                return subprocess.Popen(
                    argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                )
            except OSError as exc:
                raise SupervisorError(f"cannot start {argv[0]!r}: {exc.strerror}") from None

    def template_for(self, argv: list[str], env: dict[str, str]) -> Template | None:
        """The template a start of ``argv`` with ``env`` would fork from (started now if new);
        None for a command line a template cannot run."""
        if not forkable(argv):
            return None
        return self.templates.want(argv[0], self._worker_env("", "", "", env, _placed_gpus(env)), time.monotonic())

    def _fork(self, argv: list[str], env: dict[str, str], workdir: Path, log_path: Path) -> ForkedChild | None:
        """The worker forked from a ready template of its interpreter; None (spawn it) when the
        template is not ready or the fork fails."""
        if not forkable(argv):
            return None
        template = self.templates.want(argv[0], env, time.monotonic())
        return self.templates.fork(template, argv, env, str(workdir), log_path)

    def maintain_templates(self, now: float) -> None:
        """Notice ready or dead templates and start again the ones that died."""
        self.templates.maintain(now)

    def _pick_gpu(self, env: dict[str, str]) -> int | None:
        """The GPU a new worker uses: the first of its CUDA_VISIBLE_DEVICES, else the least busy one."""
        visible = str(env.get("CUDA_VISIBLE_DEVICES", "")).split(",")[0].strip()
        if visible.isdigit():
            return int(visible)
        if self._gpu_count == 0:
            return None
        users = [record.gpu for record in self.live()]
        return min(range(self._gpu_count), key=lambda index: (users.count(index), index))

    def _worker_env(self, wid: str, slot: str, role: str, extra: dict[str, str], placed: list[int]) -> dict[str, str]:
        config = self._config
        env = dict(os.environ)
        env.update({str(key): str(value) for key, value in extra.items()})
        if placed:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(placed, os.environ.get("CUDA_VISIBLE_DEVICES"))
            env[protocol.NODE_DEVICES_ENV] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        env.update({
            "RLCTL_AGENT_SOCK": str(config.socket_path), "RLCTL_WORKER_ID": wid, "RLCTL_SLOT": str(slot),
            "RLCTL_ROLE": role, "RLCTL_NODE": config.node, "RLCTL_JOB_ID": config.job_id,
            "RLCTL_WORKDIR": str(config.workdir),
            # Proves to the job's weight holders that this worker belongs to the job.
            protocol.WEIGHTS_TOKEN_ENV: protocol.weights_token(config.secret),
        })
        return env

    def send_signal(self, record: WorkerRecord, signum: int) -> bool:
        """Signal the worker's process group (its pid alone if it leads none); False if it is gone."""
        if record.exited or (record.adopted and not process_alive(record.pid, record.start_time)):
            return False
        try:
            if os.getpgid(record.pid) == record.pid:
                os.killpg(record.pid, signum)
            else:
                os.kill(record.pid, signum)
        except ProcessLookupError:
            return False
        if signum == signal.SIGSTOP:
            record.suspended = True
        elif signum in (signal.SIGCONT, signal.SIGKILL):
            record.suspended = False
        return True

    def poll(self) -> list[WorkerExit]:
        """Exits seen since the last call (each reported once); persists the table when any."""
        exits = [exit_ for record in self.live() if (exit_ := self._check_exit(record)) is not None]
        if exits:
            self.save_state()
        return exits

    def _check_exit(self, record: WorkerRecord) -> WorkerExit | None:
        if record.popen is not None:
            code = record.popen.poll()
            if code is None:
                return None
            record.exited = True
            if isinstance(record.popen, ForkedChild) and record.popen.untracked:
                return WorkerExit(record.wid, None, None, "untracked-exit", last_error(record.log_path, record.log_start))
            error = last_error(record.log_path, record.log_start) if code != 0 else ""
            if code < 0:
                return WorkerExit(record.wid, None, signal_name(-code), "killed-by-signal",
                                  signal_error(-code, last_error(record.log_path, record.log_start)))
            return WorkerExit(record.wid, code, None, "exited", error)
        if process_alive(record.pid, record.start_time):
            return None
        record.exited = True
        return WorkerExit(record.wid, None, None, "untracked-exit", last_error(record.log_path, record.log_start))

    def forget_exited(self, keep: int = 1000) -> None:
        """Drop the oldest exited records beyond ``keep`` (kept so start_worker stays idempotent)."""
        exited = [wid for wid, record in self.workers.items() if record.exited]
        for wid in exited[: max(0, len(exited) - keep)]:
            del self.workers[wid]

    def save_state(self) -> bool:
        """Write the live worker table atomically, readable by the owner only. A disk that is full
        or failing leaves the previous table (a restarted agent adopts from it what still runs) and
        is logged once until a write succeeds again: the agent and its workers go on."""
        path = self._config.state_path
        body = {"version": STATE_VERSION, "node": self._config.node, "job_id": self._config.job_id,
                "workers": [record.state_entry() for record in self.live()]}
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(body, handle)
            os.replace(tmp, path)
        except OSError as exc:
            if not self._state_unwritable:
                log.warning("could not write the worker table %s (%s): keeping the previous one", path, exc)
            self._state_unwritable = True
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        if self._state_unwritable:
            log.info("the worker table %s is written again", path)
        self._state_unwritable = False
        return True

    def adopt_from_state(self) -> list[WorkerExit]:
        """Re-adopt the persisted workers still alive; return exits for those that ended meanwhile."""
        entries = self._read_state()
        gone = []
        for entry in entries:
            try:
                record = self._record_from_state(entry)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring malformed worker entry in %s: %s", self._config.state_path, exc)
                continue
            self.workers[record.wid] = record
            if process_alive(record.pid, record.start_time):
                log.info("re-adopted worker %s pid %d", record.wid, record.pid)
            else:
                record.exited = True
                gone.append(WorkerExit(record.wid, None, None, "untracked-exit"))
        if entries:
            self.save_state()
        return gone

    def _read_state(self) -> list[dict[str, Any]]:
        path = self._config.state_path
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s); starting with an empty worker table", path, exc)
            return []
        if body.get("job_id") != self._config.job_id or body.get("node") != self._config.node:
            log.warning("%s belongs to another job or node; not re-adopting its workers", path)
            return []
        workers = body.get("workers", [])
        return workers if isinstance(workers, list) else []

    @staticmethod
    def _record_from_state(entry: dict[str, Any]) -> WorkerRecord:
        log_path = Path(entry["log_path"])
        wid = str(entry["wid"])
        return WorkerRecord(
            wid=wid, slot=str(entry["slot"]), role=str(entry["role"]), pid=int(entry["pid"]),
            start_time=int(entry["start_time"]), log_path=log_path,
            watcher=WorkerLogWatcher(wid, log_path, int(entry.get("log_offset", 0))),
            phase=str(entry.get("phase", "starting")), step=entry.get("step"), progress=entry.get("progress"),
            gpu=entry.get("gpu"), log_start=int(entry.get("log_start", 0)),
        )


def _safe_name(wid: str) -> str:
    """A file name for ``wid`` that cannot escape the logs directory."""
    cleaned = "".join(char if char.isalnum() or char in "-_." else "_" for char in wid)
    return cleaned.lstrip(".") or "worker"
