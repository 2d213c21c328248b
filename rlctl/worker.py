"""Worker SDK: how a role program (trainer, rollout, reward) talks to its node agent. Stdlib only.

The agent starts a role program with ``RLCTL_AGENT_SOCK``, ``RLCTL_WORKER_ID``, ``RLCTL_SLOT``,
``RLCTL_ROLE``, ``RLCTL_NODE``, ``RLCTL_JOB_ID`` and ``RLCTL_WORKDIR`` in its environment. The
program then does::

    from rlctl import worker
    w = worker.connect()                    # WorkerNotManaged outside an agent
    w.phase("generating", step=3)           # sent at once
    w.progress(n)                           # cheap; coalesced, carried by the agent's heartbeats
    reply = w.request("rollout.get_work", capacity=8, timeout=30.0)
    w.notify("weights.held", version=3, source={...})
    w.on_command(callback)                  # e.g. {"name": "nccl-timeout", "params": {...}}

One background thread keeps the unix-socket connection to the agent, reconnecting (to a
restarted agent too) with backoff; on reconnect it re-sends hello, the current phase and
progress, queued notifications and every unanswered request. ``request`` retries with the same
id on timeout, so a controller or agent restart only delays the answer. Wire format: JSON lines
``hello {wid}``, ``phase {phase, step}``, ``progress {value}``, ``msg {payload}`` to the agent;
``msg {payload}``, ``command {name, params}`` and ``controller {epoch}`` (a controller is reachable
again: unanswered requests are re-sent at once) from it (see docs/architecture.md).
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "RequestFailed",
    "RequestTimeout",
    "Worker",
    "WorkerIdentity",
    "WorkerNotManaged",
    "connect",
    "torch_watchdog_timeout_text",
]

PROGRESS_FLUSH_S = 0.1
RECONNECT_INITIAL_S = 0.05
RECONNECT_MAX_S = 1.0
NOTIFY_BACKLOG = 1000
_MAX_LINE_BYTES = 8 * 1024 * 1024

CommandCallback = Callable[[dict[str, Any]], Any]
MessageCallback = Callable[[Any], Any]


class WorkerNotManaged(RuntimeError):
    """The program was not started by an rlctl agent (the RLCTL_* variables are absent)."""


class RequestFailed(RuntimeError):
    """The controller answered a request with ``ok: false``."""

    def __init__(self, op: str, error: Any) -> None:
        super().__init__(f"{op} failed: {error}")
        self.op = op
        self.error = error


class RequestTimeout(TimeoutError):
    """No reply to a request within ``max_wait``."""


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is, from the environment the agent set."""

    wid: str
    slot: str
    role: str
    node: str
    job_id: str
    workdir: str
    agent_sock: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerIdentity:
        missing = [name for name in ("RLCTL_AGENT_SOCK", "RLCTL_WORKER_ID") if not env.get(name)]
        if missing:
            raise WorkerNotManaged(f"not started by an rlctl agent: {', '.join(missing)} not set")
        return cls(wid=env["RLCTL_WORKER_ID"], slot=env.get("RLCTL_SLOT", ""),
                   role=env.get("RLCTL_ROLE", ""), node=env.get("RLCTL_NODE", ""),
                   job_id=env.get("RLCTL_JOB_ID", ""), workdir=env.get("RLCTL_WORKDIR", ""),
                   agent_sock=env["RLCTL_AGENT_SOCK"])


@dataclass
class _PendingRequest:
    line: bytes
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] = field(default_factory=dict)


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class Worker:
    """A connection to the node agent. Thread-safe; create it with ``connect()``."""

    def __init__(self, identity: WorkerIdentity) -> None:
        self.identity = identity
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._phase: tuple[str, int | None] = ("starting", None)
        self._progress: Any = None
        self._progress_dirty = False
        self._progress_sent_at = 0.0
        self._notify_backlog: collections.deque[bytes] = collections.deque(maxlen=NOTIFY_BACKLOG)
        self._requests: dict[str, _PendingRequest] = {}
        self._command_callbacks: list[CommandCallback] = []
        self._message_callbacks: list[MessageCallback] = []
        self._default_commands: dict[str, Callable[[dict[str, Any]], None]] = {"nccl-timeout": self._nccl_timeout}
        self._thread = threading.Thread(target=self._run, name="rlctl-worker-io", daemon=True)
        self._thread.start()

    # ---- public API ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the agent connection is up right now."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until connected to the agent (True) or ``timeout`` passes (False)."""
        return self._connected.wait(timeout)

    def phase(self, name: str, step: int | None = None) -> None:
        """Enter phase ``name`` (at training/rollout step ``step``); sent to the agent at once."""
        with self._lock:
            self._phase = (name, step)
            self._send_locked({"type": "phase", "phase": name, "step": step})

    def progress(self, value: float) -> None:
        """Report a progress counter; cheap (sent at most every 0.1 s, the latest value wins)."""
        with self._lock:
            self._progress, self._progress_dirty = value, True
            if time.monotonic() - self._progress_sent_at >= PROGRESS_FLUSH_S:
                self._flush_progress_locked()

    def request(self, op: str, *, timeout: float = 30.0, max_wait: float | None = None, **args: Any) -> Any:
        """Call controller op ``op`` with ``args``; return its result.

        Each attempt waits ``timeout`` s for the reply, then the request is re-sent with the same
        id (controller ops are idempotent). Gives up with RequestTimeout after ``max_wait`` s
        (never when None). Raises RequestFailed when the controller answers ``ok: false``.
        """
        request_id = uuid.uuid4().hex
        pending = _PendingRequest(_line({"type": "msg", "payload": {
            "kind": "request", "id": request_id, "op": op, "args": args}}))
        deadline = None if max_wait is None else time.monotonic() + max_wait
        with self._lock:
            self._requests[request_id] = pending
        try:
            while True:
                with self._lock:
                    self._write_locked(pending.line)
                wait_s = timeout if deadline is None else min(timeout, max(0.0, deadline - time.monotonic()))
                if pending.done.wait(wait_s):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise RequestTimeout(f"no reply to {op} within {max_wait} s")
        finally:
            with self._lock:
                self._requests.pop(request_id, None)
        if not pending.reply.get("ok"):
            raise RequestFailed(op, pending.reply.get("error"))
        return pending.reply.get("result")

    def notify(self, op: str, **args: Any) -> None:
        """Fire-and-forget message to the controller; queued (bounded) while disconnected."""
        line = _line({"type": "msg", "payload": {"kind": "notify", "op": op, "args": args}})
        with self._lock:
            if not self._write_locked(line):
                self._notify_backlog.append(line)

    def on_command(self, callback: CommandCallback) -> None:
        """Call ``callback({"name", "params"})`` for each agent command (on the SDK thread).

        A callback that returns True has handled the command and replaces the default
        handler (the default for ``nccl-timeout`` prints the torch watchdog failure and aborts).
        """
        self._command_callbacks.append(callback)

    def on_message(self, callback: MessageCallback) -> None:
        """Call ``callback(payload)`` for controller messages that are not replies to requests."""
        self._message_callbacks.append(callback)

    def close(self) -> None:
        """Stop the SDK thread and close the connection."""
        self._closed.set()
        with self._lock:
            self._drop_locked()
        self._thread.join(timeout=2.0)

    # ---- sending ---------------------------------------------------------------------------

    def _send_locked(self, message: dict[str, Any]) -> bool:
        return self._write_locked(_line(message))

    def _write_locked(self, line: bytes) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendall(line)
            return True
        except OSError:
            self._drop_locked()
            return False

    def _flush_progress_locked(self) -> None:
        if self._progress_dirty and self._send_locked({"type": "progress", "value": self._progress}):
            self._progress_dirty = False
            self._progress_sent_at = time.monotonic()

    def _drop_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._connected.clear()

    # ---- connection thread -----------------------------------------------------------------

    def _run(self) -> None:
        delay = RECONNECT_INITIAL_S
        while not self._closed.is_set():
            sock = self._dial()
            if sock is None:
                self._closed.wait(random.uniform(delay / 2, delay))
                delay = min(RECONNECT_MAX_S, delay * 2)
                continue
            delay = RECONNECT_INITIAL_S
            self._serve(sock)

    def _dial(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.identity.agent_sock)
        except OSError:
            sock.close()
            return None
        with self._lock:
            self._sock = sock
            self._introduce_locked()
            if self._sock is not sock:
                return None
            self._connected.set()
        return sock

    def _introduce_locked(self) -> None:
        """After (re)connecting: hello, current state, queued notifications, unanswered requests."""
        name, step = self._phase
        self._send_locked({"type": "hello", "wid": self.identity.wid})
        self._send_locked({"type": "phase", "phase": name, "step": step})
        if self._progress is not None:
            self._progress_dirty = True
            self._flush_progress_locked()
        while self._notify_backlog and self._write_locked(self._notify_backlog[0]):
            self._notify_backlog.popleft()
        for pending in list(self._requests.values()):
            self._write_locked(pending.line)

    def _serve(self, sock: socket.socket) -> None:
        buffer = b""
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([sock], [], [], PROGRESS_FLUSH_S)
            except (OSError, ValueError):  # closed by a writer thread that saw the agent go away
                return
            if readable:
                try:
                    chunk = sock.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    with self._lock:
                        if self._sock is sock:
                            self._drop_locked()
                    return
                *lines, buffer = (buffer + chunk).split(b"\n")
                if len(buffer) > _MAX_LINE_BYTES:
                    buffer = b""
                for line in lines:
                    self._handle_line(line)
            with self._lock:
                if self._sock is not sock:
                    return
                if time.monotonic() - self._progress_sent_at >= PROGRESS_FLUSH_S:
                    self._flush_progress_locked()

    def _handle_line(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if message.get("type") == "msg":
            self._handle_payload(message.get("payload"))
        elif message.get("type") == "command":
            self._handle_command({"name": message.get("name"), "params": message.get("params") or {}})
        elif message.get("type") == "controller":
            self._resend_requests()

    def _resend_requests(self) -> None:
        """The agent (re)connected to a controller: a request written while the previous one was
        dying may never be answered, so every unanswered one goes again now (same id; ops are
        idempotent) instead of after its attempt timeout."""
        with self._lock:
            for pending in list(self._requests.values()):
                if not pending.done.is_set():
                    self._write_locked(pending.line)

    def _handle_payload(self, payload: Any) -> None:
        if isinstance(payload, dict) and payload.get("kind") == "reply":
            with self._lock:
                pending = self._requests.get(str(payload.get("id")))
            if pending is not None:
                pending.reply = payload
                pending.done.set()
            return
        for callback in list(self._message_callbacks):
            _call_safely(callback, payload)

    def _handle_command(self, command: dict[str, Any]) -> None:
        handled = any(_call_safely(callback, command) is True for callback in list(self._command_callbacks))
        default = self._default_commands.get(str(command["name"]))
        if not handled and default is not None:
            default(command["params"])

    def _nccl_timeout(self, params: dict[str, Any]) -> None:
        """Die the way a rank does when torch's NCCL watchdog catches a collective timeout."""
        rank = int(params.get("rank", os.environ.get("RANK", "0")))
        text = torch_watchdog_timeout_text(
            rank=rank, seq=int(params.get("seq", 1)), op_type=str(params.get("op_type", "ALLREDUCE")),
            numel=int(params.get("numel", 1)), timeout_ms=int(params.get("timeout_ms", 600_000)),
            flight_recorder=bool(params.get("flight_recorder", True)),
        )
        sys.stderr.write(text)
        sys.stderr.flush()
        os.abort()


def _call_safely(callback: Callable[[Any], Any], argument: Any) -> Any:
    try:
        return callback(argument)
    except Exception as exc:  # noqa: BLE001 - a user callback must not kill the SDK thread
        print(f"rlctl.worker: callback {callback!r} raised {exc!r}", file=sys.stderr)
        return None


def torch_watchdog_timeout_text(rank: int, seq: int, op_type: str = "ALLREDUCE", numel: int = 1,
                                timeout_ms: int = 600_000, flight_recorder: bool = True,
                                now: datetime | None = None) -> str:
    """What PyTorch's ProcessGroupNCCL writes to stderr when its watchdog catches a timeout.

    Same messages and glog prefix as torch (``[rank1]:[E1003 18:37:01.833575187
    ProcessGroupNCCL.cpp:1664] ...``), ending with the ``c10::DistBackendError`` termination.
    """
    now = now or datetime.now()
    ran_ms = timeout_ms + random.randint(5, 120)
    pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {rank}]"
    work = (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op_type}, "
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)={timeout_ms}) ran for {ran_ms} milliseconds "
            f"before timing out.")
    terminated = f"{pg} Process group watchdog thread terminated with exception: {work}"
    raised = ("Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:686 "
              "(most recent call first):")

    def glog(line_no: int, text: str) -> str:
        stamp = f"{now:%m%d %H:%M:%S}.{now.microsecond * 1000:09d}"
        return f"[rank{rank}]:[E{stamp} ProcessGroupNCCL.cpp:{line_no}] {text}"

    lines = [
        glog(684, work),
        glog(1785, f"{pg} Exception (either an error or timeout) detected by watchdog at work: {seq}, "
                   f"last enqueued NCCL work: {seq}, last completed NCCL work: {seq - 1}."),
        glog(1834, f"{pg} Timeout at NCCL work: {seq}, last enqueued NCCL work: {seq}, "
                   f"last completed NCCL work: {seq - 1}."),
    ]
    if flight_recorder:
        lines += [
            glog(1575, f"{pg} ProcessGroupNCCL preparing to dump debug info. Include stack trace: 1, "
                       f"only active collectives: 0"),
            glog(1469, f"{pg} Finished flight recorder successfully. Output can be analyzed using the "
                       f"fr_trace script."),
        ]
    lines += [
        glog(630, f"[Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
                  f"of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."),
        glog(636, f"[Rank {rank}] To avoid data inconsistency, we are taking the entire process down."),
        glog(1595, terminated),
        raised,
        "",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        f"  what():  {terminated}",
        raised,
        "",
    ]
    return "\n".join(lines) + "\n"


_instance: Worker | None = None
_instance_lock = threading.Lock()


def node_devices(gpus: list[int], env: Mapping[str, str] | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the node's GPUs ``gpus`` (local indices), as the agent maps a
    worker's own: through the node's list it passes as ``RLCTL_NODE_DEVICES``, else the indices.
    A worker that grows over other GPUs of its node (elastic rollout) starts its engine with it."""
    own = [part.strip() for part in (env or os.environ).get("RLCTL_NODE_DEVICES", "").split(",") if part.strip()]
    return ",".join(own[index] if index < len(own) else str(index) for index in gpus)


class _LogStream:
    """``sys.stdout``/``sys.stderr`` of a worker whose log is a file: what cannot be written (the
    log's disk full or failing) is dropped, never raised into the role's code; everything else is
    the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.dropped_writes = 0

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except OSError:
            self.dropped_writes += 1
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self.dropped_writes += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def keep_going_when_the_log_is_full() -> None:
    """Make this worker's stdout and stderr drop what its log cannot take (once per process)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _LogStream):
            setattr(sys, name, _LogStream(stream))


def connect(wait_s: float = 5.0, env: Mapping[str, str] | None = None) -> Worker:
    """The process's agent connection (created on first call; later calls return the same one).

    Raises WorkerNotManaged when the RLCTL_* variables are absent. Waits up to ``wait_s`` for
    the first connection; if the agent is not there yet, the SDK keeps trying in the background.
    """
    global _instance
    identity = WorkerIdentity.from_env(os.environ if env is None else env)
    keep_going_when_the_log_is_full()
    with _instance_lock:
        if _instance is None or _instance.identity != identity:
            _instance = Worker(identity)
        worker = _instance
    if not worker.wait_connected(wait_s):
        print(f"rlctl.worker: agent socket {identity.agent_sock} not reachable yet; retrying in the background",
              file=sys.stderr)
    return worker
