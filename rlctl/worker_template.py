"""The host's worker template: a warm interpreter that role workers are forked from.

A node agent (stdlib only) starts ``python -m rlctl.worker_template --name NAME`` with the job's
interpreter, in a session of its own. The template binds the abstract unix socket ``NAME`` (a
second template for the same name exits at once with ``EXIT_NAME_TAKEN``, so agents racing to
start one end up sharing it), imports torch, transformers and rlctl's role code once (never
initialising CUDA: forking after CUDA init is unsafe), and then serves every agent of the job on
this host that connects: on the local backend that is every virtual node, on ssh and Slurm the
node's own agent. Only processes of the template's own user are served (``SO_PEERCRED``).

One JSON object per line:

    template → agent  {"type": "ready", "pid": P, "import_s": S, "cuda_initialized": false, "preloaded": [...]}
    agent → template  {"type": "fork", "argv": [...], "env": {...}, "cwd": "...", "log": "..."}
    template → agent  {"type": "forked", "pid": W}   or   {"type": "error", "error": "..."}
                      {"type": "exited", "pid": W, "code": C}   (an exit code, or minus the signal)

The template is the forked workers' parent: it reaps each one and tells the agent that asked for
it how it ended, so the agent reports exit codes and killing signals as for a worker it spawned.
A worker starts its own session (the agent signals its process group), sends stdout and stderr to
its log file, takes the request's environment and working directory, and then runs ``argv`` as
``python`` would: ``[python, "-m", module, *args]`` or ``[python, script.py, *args]``. Its
interpreter exits as a plain one does (atexit handlers, non-daemon threads joined, SystemExit's
code). Workers outlive a template that dies; their agents then see them end without a code.

An agent that leaves for good (none of its workers left running) says ``{"type": "bye"}``. The
template exits when the last agent leaves that way, and otherwise once no agent has been
connected for ``RLCTL_TEMPLATE_IDLE_S`` seconds (default ``IDLE_EXIT_S``), which covers an
agent's restart. ``RLCTL_TEMPLATE_PRELOAD``
(comma-separated ``module`` or ``module:attribute``) replaces the default preload list.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl_agent.protocol import JsonLines

PRELOAD_ENV = "RLCTL_TEMPLATE_PRELOAD"
DEFAULT_PRELOAD = (
    "torch", "transformers", "transformers:AutoModelForCausalLM", "transformers:AutoTokenizer",
    "transformers.models.qwen3.modeling_qwen3",
    "rlctl.worker", "rlctl.roles.common", "rlctl.roles.trainer", "rlctl.roles.rollout", "rlctl.roles.reward",
    "rlctl.roles.env", "rlctl.roles.standby",
    "rlctl.workload.trainer", "rlctl.workload.algorithms", "rlctl.workload.policy_update", "rlctl.workload.engine",
    "rlctl.workload.hf_model",
    "rlctl.workload.hf_tokenizer", "rlctl.workload.rewardfn", "rlctl.workload.offload",
    "rlctl.workload.rank_state", "rlctl.workload.multiturn", "rlctl.workload.envs", "rlctl.weights",
)
IDLE_ENV = "RLCTL_TEMPLATE_IDLE_S"
IDLE_EXIT_S = 10.0
POLL_S = 0.05
SEND_TIMEOUT_S = 2.0
EXIT_NAME_TAKEN = 3
EXIT_LOG_UNWRITABLE = 126
EXIT_SETUP_FAILED = 127
MAX_REQUEST_BYTES = 16 * 1024 * 1024


class TemplateError(Exception):
    """A fork request is malformed or names a program the template cannot run."""


@dataclass(frozen=True)
class ForkRequest:
    """One worker to fork: its argv (the template's own interpreter first), environment, cwd and log."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ForkRequest:
        argv, env = message.get("argv"), message.get("env")
        if not isinstance(argv, list) or len(argv) < 2 or not all(isinstance(a, str) for a in argv):
            raise TemplateError("argv must be a list of at least two strings")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TemplateError("env must be an object of strings")
        if argv[1] == "-m" and len(argv) < 3:
            raise TemplateError("argv has -m without a module")
        if argv[1] != "-m" and argv[1].startswith("-"):
            raise TemplateError(f"interpreter option {argv[1]!r} is not supported (only -m MODULE or a script)")
        return cls(argv=argv, env=env, cwd=str(message.get("cwd") or "."), log=str(message["log"]))


def preload(names: list[str]) -> list[str]:
    """Import each ``module`` (and read ``module:attribute``, for lazy packages); the names that
    loaded. One that cannot be imported (an optional engine) is left out, not fatal."""
    loaded = []
    for name in names:
        module_name, _, attribute = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            if attribute:
                getattr(module, attribute)
        except Exception as exc:  # noqa: BLE001 - an optional module must not stop the template
            print(f"worker template: preload {name} failed: {exc!r}", file=sys.stderr, flush=True)
            continue
        loaded.append(name)
    return loaded


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (never true in a healthy template)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


class Client:
    """One connected agent: JSON lines in and out, and the workers forked for it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(SEND_TIMEOUT_S)
        self._lines = JsonLines()
        self.open = True
        self.leaving = False  # said "bye": its agent is gone for good, with no worker left running

    def send(self, message: dict[str, Any]) -> None:
        if not self.open:
            return
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            self.open = False  # an agent that does not read (or is gone) is let go

    def read(self) -> list[dict[str, Any]]:
        """The requests that have arrived (call when readable); marks the client closed at end of file."""
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.open = False
            return []
        messages = [body if body is not None else {"type": "unreadable"} for body in self._lines.feed(chunk)]
        if self._lines.pending_bytes > MAX_REQUEST_BYTES:
            self.send({"type": "error", "error": "request too large"})
            self.open = False
        return messages


def bind(name: str) -> socket.socket | None:
    """The listening socket at abstract address ``name``; None if another template holds it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError:
        listener.close()
        return None
    listener.listen(64)
    return listener


def same_user(sock: socket.socket) -> bool:
    """Whether the peer runs as this process's user (``SO_PEERCRED``)."""
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _, uid, _ = struct.unpack("3i", credentials)
    return uid == os.getuid()


class TemplateServer:
    """Accepts agents, forks workers on request, reaps them and tells their agent how they ended."""

    def __init__(self, listener: socket.socket, ready: dict[str, Any], idle_exit_s: float) -> None:
        self.listener = listener
        self.ready = ready
        self.idle_exit_s = idle_exit_s
        self.clients: list[Client] = []
        self.owners: dict[int, Client] = {}
        self.last_client_at = time.monotonic()
        self.expect_return = True  # the last agent to leave may come back (it did not say bye)

    def serve(self) -> ForkRequest | None:
        """Serve until idle (returns None, in the template) or until this process is a newly forked
        worker (returns its request, already set up)."""
        while True:
            sockets = [self.listener] + [client.sock for client in self.clients]
            readable, _, _ = select.select(sockets, [], [], POLL_S)
            for sock in readable:
                if sock is self.listener:
                    self._accept()
                    continue
                client = next(c for c in self.clients if c.sock is sock)
                for message in client.read():
                    request = self._answer(client, message)
                    if request is not None:
                        return request
            self._reap()
            self._drop_closed()
            if self.clients:
                self.last_client_at = time.monotonic()
            elif not self.expect_return or time.monotonic() - self.last_client_at > self.idle_exit_s:
                return None

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if not same_user(sock):
            sock.close()
            return
        client = Client(sock)
        self.clients.append(client)
        client.send(self.ready)

    def _answer(self, client: Client, message: dict[str, Any]) -> ForkRequest | None:
        if message.get("type") == "bye":
            client.leaving = True
            return None
        if message.get("type") != "fork":
            client.send({"type": "error", "error": f"unknown request type {message.get('type')!r}"})
            return None
        try:
            request = ForkRequest.from_message(message)
        except (TemplateError, KeyError) as exc:
            client.send({"type": "error", "error": str(exc)})
            return None
        session_ready, session_led = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(session_ready)
            os.close(session_led)
            client.send({"type": "error", "error": f"fork failed: {exc.strerror}"})
            return None
        if pid == 0:
            os.close(session_ready)
            self._become_worker(request, session_led)
            return request
        os.close(session_led)
        os.read(session_ready, 1)  # the worker leads its session before its agent hears of it
        os.close(session_ready)
        self.owners[pid] = client
        client.send({"type": "forked", "pid": pid})
        return None

    def _become_worker(self, request: ForkRequest, session_led: int) -> None:
        for client in self.clients:
            client.sock.close()
        self.listener.close()
        os.setsid()
        os.close(session_led)
        become_worker(request)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            owner = self.owners.pop(pid, None)
            if owner is not None:
                owner.send({"type": "exited", "pid": pid, "code": code})
            # The template's log keeps every end, the ones no agent heard of included.
            told = owner is not None and owner.open
            print(f"worker template: worker {pid} ended ({describe_end(code)})"
                  f"{'' if told else '; its agent had gone'}", flush=True)

    def _drop_closed(self) -> None:
        closed = [client for client in self.clients if not client.open]
        for client in closed:
            client.sock.close()
            self.clients.remove(client)
        if closed and not self.clients:
            self.expect_return = not all(client.leaving for client in closed)


# What a newly started interpreter has: Python ignores SIGPIPE and SIGXFSZ (a write to a closed
# socket raises BrokenPipeError) and turns SIGINT into KeyboardInterrupt.
FRESH_INTERPRETER_SIGNALS: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGPIPE: signal.SIG_IGN, signal.SIGXFSZ: signal.SIG_IGN,
}


def describe_end(code: int) -> str:
    """``exit code N`` or ``killed by SIGNAME`` for a ``waitstatus_to_exitcode`` value."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def become_worker(request: ForkRequest) -> None:
    """In the forked worker (already leading its own session): stdio to the log, the request's
    environment and cwd."""
    try:
        log_fd = os.open(request.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        os._exit(EXIT_LOG_UNWRITABLE)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)
    for signum, disposition in FRESH_INTERPRETER_SIGNALS.items():
        signal.signal(signum, disposition)
    try:
        os.chdir(request.cwd)
    except OSError as exc:
        print(f"worker template: cannot enter {request.cwd}: {exc.strerror}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP_FAILED)
    os.environ.clear()
    os.environ.update(request.env)


def run_worker(request: ForkRequest) -> None:
    """Run the worker's program as ``python`` would run ``argv`` (in this, the worker process)."""
    program = request.argv[1:]
    if program[0] == "-m":
        module, args = program[1], program[2:]
        sys.path[0] = os.getcwd()
        sys.argv = [module, *args]  # run_module replaces argv[0] with the module's file
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = program[0], program[1:]
        sys.path[0] = str(Path(script).resolve().parent)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


def preload_names() -> list[str]:
    raw = os.environ.get(PRELOAD_ENV)
    if raw is None:
        return list(DEFAULT_PRELOAD)
    return [name.strip() for name in raw.split(",") if name.strip()]


def idle_exit_s() -> float:
    try:
        return max(0.5, float(os.environ.get(IDLE_ENV, IDLE_EXIT_S)))
    except ValueError:
        return IDLE_EXIT_S


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.worker_template", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the abstract unix socket name to serve agents on")
    args = parser.parse_args(argv)
    listener = bind(args.name)
    if listener is None:
        print(f"worker template: {args.name} is already served", file=sys.stderr, flush=True)
        return EXIT_NAME_TAKEN
    started = time.monotonic()
    loaded = preload(preload_names())
    if cuda_initialized():
        print("worker template: CUDA was initialised while preloading; refusing to fork workers",
              file=sys.stderr, flush=True)
        return 1
    gc.freeze()  # the preloaded objects stay out of collections: forked workers share their pages
    ready = {"type": "ready", "pid": os.getpid(), "import_s": round(time.monotonic() - started, 3),
             "cuda_initialized": False, "preloaded": loaded}
    print(f"worker template {args.name} ready: {len(loaded)} modules in {ready['import_s']} s", flush=True)
    server = TemplateServer(listener, ready, idle_exit_s())
    request = server.serve()
    if request is None:
        why = f"no agent for {idle_exit_s():.0f} s" if server.expect_return else "its last agent left"
        print(f"worker template {args.name}: {why}, exiting", flush=True)
        return 0
    run_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
