"""The agent's side of the worker template (``rlctl.worker_template``): start, ask, restart, reap.

A template is one warm interpreter per (job interpreter, import-time environment) on this node. It
is started with the job's interpreter once the node's workers are past their own imports (so the
two do not compete for the CPU at job start), restarted if it dies (at most ``MAX_FAILED_STARTS``
times in a row without reaching ``ready``), and exits by itself when the agent's end of its
socketpair closes. ``fork`` returns the pid of a worker forked from a ready template, or None, and
the caller then spawns the worker plainly: a start never fails because of the template.

Forked workers are re-parented to the agent, which makes itself a child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``) the first time it starts a template; ``ForkedChild`` reaps one
with ``waitpid``, so its exit code or killing signal is seen as for a spawned worker. Being a
subreaper also adopts the orphans of workers' own children; ``reap_orphans`` collects their zombies.

Stdlib only; not thread-safe (the agent's event loop calls it).
"""

from __future__ import annotations

import ctypes
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

log = logging.getLogger("rlctl_agent.template")

PR_SET_CHILD_SUBREAPER = 36
TEMPLATE_MODULE = "rlctl.worker_template"
FORK_REPLY_TIMEOUT_S = 10.0
MAX_FAILED_STARTS = 3
RESTART_BACKOFF_S = 2.0
STARTING_GRACE_S = 60.0  # start the template anyway once a worker has been starting this long
# Variables that differ between the workers of a node; a template's environment leaves them out,
# so every role on the node shares one template (each forked worker gets its full environment).
PER_WORKER_PREFIXES = ("RLCTL_", "TORCH_NCCL_", "NCCL_", "UCX", "CUDA_", "NVIDIA_")
PER_WORKER_NAMES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"})
KEEP_FOR_TEMPLATE = frozenset({"RLCTL_TEMPLATE_PRELOAD", "RLCTL_CACHE"})


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


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def own_children() -> list[int]:
    """The pids of this process's children (``/proc/self/task/*/children``)."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            pids.extend(int(pid) for pid in Path(f"/proc/self/task/{task}/children").read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def _is_zombie(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2:].split()[0] == "Z"


class ForkedChild:
    """A worker forked from a template and re-parented to the agent: ``poll`` like ``Popen.poll``
    (None while it runs; its exit code, or minus the signal that killed it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.untracked = False  # it ended but was not ours to reap: how is unknown

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            if _gone(self.pid):
                self.untracked, self.returncode = True, 0
            return self.returncode
        if pid == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ends (as ``Popen.wait``; ``subprocess.TimeoutExpired`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


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
    """One template process and where it stands: ``starting`` → ``ready`` → ``dead``."""

    python: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    sock: socket.socket | None = None
    state: str = "idle"
    info: dict[str, Any] = field(default_factory=dict)
    failed_starts: int = 0
    last_start: float = 0.0
    forks: int = 0
    _buffer: bytes = b""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, now: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.last_start = now
        self._buffer = b""
        try:
            with self.log_path.open("ab") as log_file:
                self.process = subprocess.Popen(
                    [self.python, "-m", TEMPLATE_MODULE, "--fd", str(theirs.fileno())], env=self.env,
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                    cwd=self.log_path.parent,
                )
        except OSError as exc:
            ours.close()
            self.failed_starts += 1
            self.state = "dead"
            log.warning("cannot start the worker template with %s: %s", self.python, exc.strerror)
            return
        finally:
            theirs.close()
        self.sock = ours
        self.state = "starting"
        log.info("worker template starting (pid %d, %s)", self.process.pid, self.python)

    def check(self) -> None:
        """Notice readiness (``starting``) or death (any state), without blocking."""
        if self.state in ("starting", "ready") and self.process is not None and self.process.poll() is not None:
            self._died(f"exited with {self.process.returncode}")
            return
        if self.state != "starting" or self.sock is None:
            return
        while True:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return
            message = self._read_line(timeout=0.0)
            if message is None:
                return
            if message.get("type") == "ready" and message.get("cuda_initialized") is False:
                self.state, self.info, self.failed_starts = "ready", message, 0
                log.info("worker template ready (pid %s, imports %.1f s)", message.get("pid"), message.get("import_s", 0))
                return
            self.kill(f"refused: {message.get('error', message)}")
            return

    def fork(self, request: dict[str, Any]) -> int | None:
        """Ask a ready template for a worker; its pid, or None (the template is then let go)."""
        if self.state != "ready" or self.sock is None:
            return None
        try:
            self.sock.settimeout(FORK_REPLY_TIMEOUT_S)
            self.sock.sendall(json.dumps({"type": "fork", **request}).encode() + b"\n")
            reply = self._read_line(timeout=FORK_REPLY_TIMEOUT_S)
        except OSError as exc:
            self.kill(f"fork request failed: {exc}")
            return None
        if reply is None or reply.get("type") != "forked":
            if reply is not None and reply.get("type") == "error":
                log.warning("worker template refused a fork: %s", reply.get("error"))
                return None
            self.kill(f"no fork answer: {reply}")
            return None
        self.forks += 1
        return int(reply["pid"])

    def _read_line(self, timeout: float) -> dict[str, Any] | None:
        """The next line: waiting up to ``timeout`` (0: only what has arrived); None if none."""
        assert self.sock is not None
        self.sock.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, TimeoutError):
                return None
            if not chunk:
                self._died("closed its socket")
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            body = json.loads(line)
        except ValueError:
            return {"type": "error", "error": f"unreadable line {line[:100]!r}"}
        return body if isinstance(body, dict) else {"type": "error", "error": "not an object"}

    def _died(self, why: str) -> None:
        if self.state == "dead":
            return
        if self.state != "ready":
            self.failed_starts += 1
        log.warning("worker template (pid %s) %s; plain spawns until it is restarted", self.pid, why)
        self._close()

    def kill(self, why: str) -> None:
        """Let this template go (SIGKILL); the next ``maintain`` may start another."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self._died(why)

    def _close(self) -> None:
        self.state = "dead"
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class WorkerTemplates:
    """The node's templates, keyed by (interpreter, template environment)."""

    def __init__(self, logs_dir: Path) -> None:
        self._logs_dir = logs_dir
        self._templates: dict[tuple[str, frozenset[tuple[str, str]]], Template] = {}
        self._subreaper: bool | None = None

    @property
    def templates(self) -> list[Template]:
        return list(self._templates.values())

    def pids(self) -> set[int]:
        return {pid for template in self._templates.values() if (pid := template.pid) is not None}

    def want(self, python: str, worker_env: dict[str, str]) -> Template | None:
        """The template for workers run by ``python`` with ``worker_env`` (registered if new; it
        starts on a later ``maintain``); None where this node cannot fork workers."""
        if self._subreaper is None:
            self._subreaper = become_subreaper()
            if not self._subreaper:
                log.warning("cannot become a child subreaper: workers are spawned, never forked")
        if not self._subreaper:
            return None
        env = template_env(worker_env)
        key = (python, frozenset(env.items()))
        template = self._templates.get(key)
        if template is None:
            index = len(self._templates)
            template = Template(python, env, self._logs_dir / f"worker-template-{index}.log")
            self._templates[key] = template
        return template

    def maintain(self, now: float, workers_importing: bool) -> None:
        """Notice ready or dead templates; start (or restart) the wanted ones that are not running,
        once no worker on the node is importing, backing off after a failed start."""
        for template in self._templates.values():
            template.check()
            if template.state not in ("idle", "dead") or template.failed_starts >= MAX_FAILED_STARTS:
                continue
            if now - template.last_start < RESTART_BACKOFF_S:
                continue
            if workers_importing and template.state == "idle":
                continue
            template.start(now)

    def fork(self, template: Template, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> int | None:
        template.check()
        return template.fork({"argv": argv, "env": env, "cwd": cwd, "log": str(log_path)})

    def reap_orphans(self, known: set[int]) -> int:
        """Collect the zombies of adopted orphans (children that are neither workers nor templates)."""
        if not self._subreaper:
            return 0
        reaped = 0
        for pid in own_children():
            if pid in known or not _is_zombie(pid):
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
            except ChildProcessError:
                continue
        return reaped

    def close(self) -> None:
        """Let every template go (their sockets close, so they exit by themselves)."""
        for template in self._templates.values():
            template._close()
            if template.process is not None:
                try:
                    template.process.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    template.process.kill()
                    template.process.wait(2)

