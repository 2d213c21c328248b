"""The agent's side of the worker template (``rlctl.worker_template``): find or start, ask, follow.

A template is one warm interpreter per (job, interpreter, import-time environment) on this host,
shared by every agent of the job here: on the local backend all virtual nodes use one, on ssh and
Slurm each node has its own. It listens on an abstract unix socket whose name is derived from that
key, so an agent finds a running one by connecting, and otherwise starts one (in its own session,
so a node-down of the agent that started it leaves it serving the others). Two agents that start
one at the same moment end up sharing the one that bound the name first.

The template forks the workers, reaps them and sends each one's end (exit code, or minus the
killing signal) to the agent that asked for it: ``ForkedChild`` reads it there, and polls like
``Popen``. If the template dies first, the worker's end is seen by polling ``/proc`` and has no
code (``untracked``). A template that dies is started again on a later ``maintain``, at most
``MAX_FAILED_STARTS`` times in a row without reaching ``ready``. ``fork`` returns the pid of a
worker forked from a ready template, or None, and the caller then spawns the worker plainly: a
start never fails because of the template.

Stdlib only; not thread-safe (the agent's event loop calls it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import JsonLines

log = logging.getLogger("rlctl_agent.template")

TEMPLATE_MODULE = "rlctl.worker_template"
EXIT_NAME_TAKEN = 3  # rlctl.worker_template: another template already serves the name
FORK_REPLY_TIMEOUT_S = 10.0
MAX_FAILED_STARTS = 3
RESTART_BACKOFF_S = 2.0
LAUNCH_TIMEOUT_S = 30.0  # a started template that cannot be reached by then is let go
READY_WAIT_S = 20.0  # how long a start waits for a starting template before it spawns instead
# Variables that differ between the workers of a node; a template's environment leaves them out,
# so every role on the node shares one template (each forked worker gets its full environment).
PER_WORKER_PREFIXES = ("RLCTL_", "TORCH_NCCL_", "TORCH_FR_", "NCCL_", "UCX", "CUDA_", "NVIDIA_")
PER_WORKER_NAMES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"})
KEEP_FOR_TEMPLATE = frozenset({"RLCTL_TEMPLATE_PRELOAD", "RLCTL_TEMPLATE_IDLE_S", "RLCTL_CACHE"})


def forkable(argv: list[str]) -> bool:
    """True for the command lines a template runs: ``[python, -m, module, ...]`` or ``[python, script.py, ...]``."""
    if len(argv) < 2:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py")


def template_env(worker_env: dict[str, str]) -> dict[str, str]:
    """The environment a template for this worker starts with: the worker's, less what is per worker."""
    return {key: value for key, value in worker_env.items()
            if key in KEEP_FOR_TEMPLATE or not (key.startswith(PER_WORKER_PREFIXES) or key in PER_WORKER_NAMES)}


def template_name(job_id: str, python: str, env: dict[str, str]) -> str:
    """The abstract socket name of the template for this job, interpreter and environment (per user)."""
    key = json.dumps([os.getuid(), job_id, python, sorted(env.items())])
    return "rlctl-worker-template-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _is_zombie(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2:].split()[0] == "Z"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


@dataclass
class Template:
    """One template and this agent's connection to it: ``idle`` → ``launching`` (this agent started
    it and is connecting) → ``starting`` (connected, it is importing) → ``ready`` → ``dead``."""

    name: str
    python: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    sock: socket.socket | None = None
    state: str = "idle"
    info: dict[str, Any] = field(default_factory=dict)
    failed_starts: int = 0
    last_start: float = 0.0
    exits: dict[int, int] = field(default_factory=dict)
    connection: int = 0  # counts connections: a worker's end is reported on the one it was forked over
    _lines: JsonLines = field(default_factory=JsonLines)

    @property
    def pid(self) -> int | None:
        """The template's pid once it said ready (or the one this agent started)."""
        if "pid" in self.info:
            return int(self.info["pid"])
        return self.process.pid if self.process is not None else None

    def start(self, now: float) -> None:
        """Connect to the running template, or start one and connect to it on a later ``check``."""
        self.last_start = now
        self._lines, self.info = JsonLines(), {}
        if self._connect():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log_path.open("ab") as log_file:
                self.process = subprocess.Popen(
                    [self.python, "-m", TEMPLATE_MODULE, "--name", self.name], env=self.env,
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    cwd=self.log_path.parent, start_new_session=True,
                )
        except OSError as exc:
            self.failed_starts += 1
            self.state = "dead"
            log.warning("cannot start the worker template with %s: %s", self.python, exc.strerror)
            return
        self.state = "launching"
        log.info("worker template starting (pid %d, %s)", self.process.pid, self.python)

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + self.name)
        except OSError:
            sock.close()
            return False
        self.sock, self.state = sock, "starting"
        self.connection += 1
        self.exits.clear()
        return True

    def check(self, now: float | None = None) -> None:
        """Notice a launched template listening, readiness, workers' ends and death; never blocks."""
        now = time.monotonic() if now is None else now
        if self.state == "launching":
            self._check_launch(now)
        if self.state in ("starting", "ready"):
            self._pump()
        if self.state != "launching" and self.process is not None and self.process.poll() is not None:
            self.process = None  # reaped: it exited (idle, or killed) after it served

    def _check_launch(self, now: float) -> None:
        if self._connect():
            return
        code = self.process.poll() if self.process is not None else None
        if code == EXIT_NAME_TAKEN and self._connect():
            return
        if code is not None:
            self._died(f"exited with {code} before it listened")
        elif now - self.last_start > LAUNCH_TIMEOUT_S:
            self.kill(f"not listening after {LAUNCH_TIMEOUT_S:.0f} s")

    def _pump(self) -> None:
        """Read every line that has arrived."""
        while self.sock is not None:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return
            for message in self._receive():
                self._take(message)

    def _take(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "exited":
            self.exits[int(message["pid"])] = int(message["code"])
        elif kind == "ready" and self.state == "starting":  # a template whose preload initialised CUDA never says it
            self.state, self.info, self.failed_starts = "ready", message, 0
            log.info("worker template ready (pid %s, imports %.1f s)", message.get("pid"), message.get("import_s", 0))

    def _receive(self) -> list[dict[str, Any]]:
        """The lines one ``recv`` completes (the connection is marked dead at end of file)."""
        assert self.sock is not None
        try:
            chunk = self.sock.recv(65536)
        except OSError as exc:
            self._died(f"connection failed: {exc}")
            return []
        if not chunk:
            self._died("closed its socket")
            return []
        return [body if body is not None else {"type": "error", "error": "an unreadable line"}
                for body in self._lines.feed(chunk)]

    def fork(self, request: dict[str, Any]) -> int | None:
        """Ask a ready template for a worker; its pid, or None (spawn it instead)."""
        self.check()
        if self.state != "ready" or self.sock is None:
            return None
        try:
            self.sock.sendall(json.dumps({"type": "fork", **request}).encode() + b"\n")
        except OSError as exc:
            self._died(f"fork request failed: {exc}")
            return None
        deadline = time.monotonic() + FORK_REPLY_TIMEOUT_S
        while self.sock is not None and time.monotonic() < deadline:
            readable, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                break
            answer: dict[str, Any] | None = None
            for message in self._receive():  # the answer may share a read with other workers' ends
                if answer is None and message.get("type") in ("forked", "error"):
                    answer = message
                else:
                    self._take(message)
            if answer is not None and answer.get("type") == "forked":
                return int(answer["pid"])
            if answer is not None:
                log.warning("worker template refused a fork: %s", answer.get("error"))
                return None
        if self.sock is not None:
            self._died("no answer to a fork request")
        return None

    def exit_of(self, pid: int) -> int | None:
        """How a worker it forked for this agent ended, once the template has said so."""
        self.check()
        return self.exits.pop(pid, None)

    def still_reports(self, connection: int) -> bool:
        """Whether the connection a worker was forked over is still open (and so will report its end)."""
        return self.sock is not None and self.connection == connection

    def _died(self, why: str) -> None:
        if self.state == "dead":
            return
        if self.state != "ready":
            self.failed_starts += 1
        log.warning("worker template (pid %s) %s; plain spawns until it is restarted", self.pid, why)
        self._close()

    def kill(self, why: str) -> None:
        """Let go of a template this agent started that never came to listen: it is killed."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self._died(why)

    def _close(self) -> None:
        self.state = "dead"
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class ForkedChild:
    """A worker forked by a template: ``poll`` like ``Popen.poll`` (None while it runs; its exit
    code, or minus the signal that killed it, as the template reports it)."""

    def __init__(self, pid: int, template: Template) -> None:
        self.pid = pid
        self.template = template
        self.connection = template.connection
        self.returncode: int | None = None
        self.untracked = False  # it ended after its template died: how is unknown

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.template.exit_of(self.pid) if self.template.connection == self.connection else None
        if code is not None:
            self.returncode = code
        elif not self.template.still_reports(self.connection) and _gone(self.pid):
            self.untracked, self.returncode = True, 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ends (as ``Popen.wait``; ``subprocess.TimeoutExpired`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


class WorkerTemplates:
    """The templates this agent uses, keyed by (interpreter, template environment)."""

    def __init__(self, logs_dir: Path, job_id: str) -> None:
        self._logs_dir = logs_dir
        self._job_id = job_id
        self._templates: dict[str, Template] = {}

    @property
    def templates(self) -> list[Template]:
        return list(self._templates.values())

    def want(self, python: str, worker_env: dict[str, str], now: float) -> Template:
        """The template for workers run by ``python`` with ``worker_env``; a new one is started
        (or found running) at once."""
        env = template_env(worker_env)
        name = template_name(self._job_id, python, env)
        template = self._templates.get(name)
        if template is None:
            template = Template(name, python, env, self._logs_dir / f"worker-template-{len(self._templates)}.log")
            self._templates[name] = template
            template.start(now)
        return template

    def maintain(self, now: float) -> None:
        """Notice ready or dead templates; start again the ones that died, backing off after a failed start."""
        for template in self._templates.values():
            template.check(now)
            if template.state != "dead" or template.failed_starts >= MAX_FAILED_STARTS:
                continue
            if now - template.last_start >= RESTART_BACKOFF_S:
                template.start(now)

    def fork(self, template: Template, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> ForkedChild | None:
        pid = template.fork({"argv": argv, "env": env, "cwd": cwd, "log": str(log_path)})
        return ForkedChild(pid, template) if pid is not None else None

    def close(self, for_good: bool) -> None:
        """Let every template go. ``for_good``: this agent leaves no worker running, so a template
        it was the last user of exits at once (otherwise it waits a while for a restarted agent)."""
        for template in self._templates.values():
            if for_good and template.sock is not None:
                try:
                    template.sock.sendall(b'{"type": "bye"}\n')
                except OSError:
                    pass
            template._close()
