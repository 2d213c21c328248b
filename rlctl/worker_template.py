"""The per-node worker template: a warm interpreter that role workers are forked from.

The node agent (stdlib only) starts ``python -m rlctl.worker_template --fd N`` with the job's
interpreter, handing it one end of a unix socketpair as fd N. The template imports torch,
transformers and rlctl's role code once (never initialising CUDA: forking after CUDA init is
unsafe), says ``ready``, then answers fork requests, one JSON object per line:

    agent → template  {"type": "fork", "argv": [...], "env": {...}, "cwd": "...", "log": "..."}
    template → agent  {"type": "ready", "pid": P, "import_s": S, "cuda_initialized": false, "preloaded": [...]}
                      {"type": "forked", "pid": W}   or   {"type": "error", "error": "..."}

A fork is a double fork: the template forks a short-lived middle process, which forks the worker
and exits at once. The template reaps the middle process before it answers, so by then the worker
has been re-parented to the agent (a child subreaper): the agent reaps it with ``waitpid`` and sees
its exit code or killing signal exactly as for a worker it spawned itself. The worker starts its
own session (so the agent signals its process group), sends stdout and stderr to its log file,
takes the request's environment and working directory, and then runs ``argv`` as ``python`` would:
``[python, "-m", module, *args]`` or ``[python, script.py, *args]``. Its interpreter exits as a
plain one does (atexit handlers, non-daemon threads joined, SystemExit's code).

The template exits when the agent's end of the socket closes (the agent died or let it go).
``RLCTL_TEMPLATE_PRELOAD`` (comma-separated ``module`` or ``module:attribute``) replaces the
default preload list.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD_ENV = "RLCTL_TEMPLATE_PRELOAD"
DEFAULT_PRELOAD = (
    "torch", "transformers", "transformers:AutoModelForCausalLM", "transformers:AutoTokenizer",
    "transformers.models.qwen3.modeling_qwen3",
    "rlctl.worker", "rlctl.roles.common", "rlctl.roles.trainer", "rlctl.roles.rollout", "rlctl.roles.reward",
    "rlctl.roles.env", "rlctl.roles.standby",
    "rlctl.workload.trainer", "rlctl.workload.grpo", "rlctl.workload.engine", "rlctl.workload.hf_model",
    "rlctl.workload.hf_tokenizer", "rlctl.workload.rewardfn", "rlctl.workload.offload",
    "rlctl.workload.rank_state", "rlctl.workload.multiturn", "rlctl.workload.envs", "rlctl.weights",
)
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


class Channel:
    """JSON lines over the template's end of the socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict[str, Any] | None:
        """The next message; None at end of file (the agent is gone)."""
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buffer += chunk
            if len(self._buffer) > MAX_REQUEST_BYTES:
                raise TemplateError("request too large")
        line, _, self._buffer = self._buffer.partition(b"\n")
        body = json.loads(line)
        if not isinstance(body, dict):
            raise TemplateError("a request must be a JSON object")
        return body


def serve(channel: Channel) -> ForkRequest | None:
    """Answer fork requests until the agent goes away (returns None in the template) or this
    process is a newly forked worker (returns its request, already set up)."""
    while True:
        message = channel.receive()
        if message is None:
            return None
        if message.get("type") != "fork":
            channel.send({"type": "error", "error": f"unknown request type {message.get('type')!r}"})
            continue
        try:
            request = ForkRequest.from_message(message)
        except (TemplateError, KeyError) as exc:
            channel.send({"type": "error", "error": str(exc)})
            continue
        worker_pid = double_fork(channel, request)
        if worker_pid == 0:
            return request
        channel.send({"type": "forked", "pid": worker_pid})


def double_fork(channel: Channel, request: ForkRequest) -> int:
    """Fork the worker through a middle process that exits at once; the worker's pid in the
    template, 0 in the worker (set up and ready to run)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        try:
            worker = os.fork()
        except OSError:
            os._exit(EXIT_SETUP_FAILED)
        if worker == 0:
            os.close(write_end)
            become_worker(channel, request)
            return 0
        os.write(write_end, str(worker).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        reported = pipe.read()
    os.waitpid(middle, 0)  # after this the worker's parent is the agent
    if not reported:
        raise TemplateError("the middle process could not fork the worker")
    return int(reported)


def become_worker(channel: Channel, request: ForkRequest) -> None:
    """In the forked worker: own session, stdio to the log, the request's environment and cwd."""
    channel.sock.close()
    os.setsid()
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
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.worker_template", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this end of the agent's unix socketpair")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    channel = Channel(sock)
    started = time.monotonic()
    loaded = preload(preload_names())
    if cuda_initialized():
        channel.send({"type": "error", "error": "CUDA was initialised while preloading; refusing to fork workers"})
        return 1
    channel.send({"type": "ready", "pid": os.getpid(), "import_s": round(time.monotonic() - started, 3),
                  "cuda_initialized": False, "preloaded": loaded})
    request = serve(channel)
    if request is None:
        return 0
    del channel, sock
    run_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
