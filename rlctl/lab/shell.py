"""Subprocess helpers for the lab: run a command, run it inside a node, start a daemon.

Every failure raises :class:`LabError` naming the command and what it printed, so a broken
``lab up`` says which step and which node failed. Nothing here uses a shell: argv lists only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


class LabError(RuntimeError):
    """A lab step failed; the message names the node/command and what went wrong."""


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 60.0,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion and capture its output. Raises LabError on failure when ``check``."""
    try:
        proc = subprocess.run(
            list(argv),
            check=False,
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            stdin=None if input_text is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise LabError(f"command not found: {argv[0]} (in: {' '.join(argv)})") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise LabError(f"`{' '.join(argv)}` exited {proc.returncode}: {detail}")
    return proc


def start_daemon(argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None) -> None:
    """Start a self-daemonizing program; its early output goes to ``log_path``, never to a pipe.

    (A daemon that inherits a pipe keeps it open and ``subprocess.run`` would wait forever.)
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            rc = subprocess.call(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60,
                env=dict(env) if env is not None else None,
            )
        except FileNotFoundError as exc:
            raise LabError(f"command not found: {argv[0]}") from exc
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-800:]
        raise LabError(f"`{' '.join(argv)}` exited {rc}; last output in {log_path}:\n{tail}")


def is_root() -> bool:
    """True when running as uid 0 (the lab creates namespaces and bridges)."""
    return os.geteuid() == 0


def missing_tools(tools: Sequence[str]) -> list[str]:
    """The programs in ``tools`` that are not on PATH (or at their absolute path)."""
    return [t for t in tools if shutil.which(t) is None and not Path(t).exists()]


def pid_alive(pidfile: Path) -> int | None:
    """The pid recorded in ``pidfile`` if that process still exists, else None."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid
