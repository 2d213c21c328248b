"""A child process that runs the user's code one request at a time, so that code cannot hang or kill its caller.

Role: what the reward function (``rewardfn.SandboxedScorer``) and the environment class
(``envs.EnvHost``) both run in. The child (``child_loop``) loads the user's code once, says
``ready`` (or why it could not load), then answers each request with ``ok`` and the result or
``error`` and the exception. ``ChildSandbox.call`` always returns: a call past its time limit kills
the child, a child that dies is noticed, and the next call starts a fresh one. Loading the user's
code imports user modules by location (``import_location``: a dotted module or a ``.py`` file).
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 120.0


def import_location(location: str, base_dir: Path | None = None) -> Any:
    """The module at ``location``: a file (``path/to/file.py``, relative to ``base_dir``) or a dotted
    module name. Raises ``FileNotFoundError`` for a missing file; anything the module raises while
    it is imported propagates."""
    if not (location.endswith(".py") or "/" in location):
        return importlib.import_module(location)
    path = Path(location).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    module_name = f"rlctl_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def child_loop(conn: Any, load: Callable[[], Callable[[Any], Any]], load_error: type[Exception]) -> None:
    """The child's side: ``load()`` the handler once, then answer one request per message."""
    try:
        handle = load()
    except load_error as exc:
        conn.send(("load-error", str(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", handle(request)))
        except BaseException as exc:  # noqa: BLE001 - contain whatever the user's code raises
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))


class ChildSandbox:
    """The parent's side. ``target(conn, *args)`` runs in a spawned child and calls ``child_loop``;
    ``what`` names the user's code in messages (``the environment``), ``label`` prefixes load
    failures, which raise ``load_error``."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], what: str, label: str,
                 load_error: type[Exception]) -> None:
        self.target, self.args = target, args
        self.what, self.label, self.load_error = what, label, load_error
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Any = None
        self._started = False
        self.restarts = 0  # children started after the first (a timeout or a death ended the last)

    def call(self, request: Any, timeout_s: float) -> tuple[str, Any]:
        """``("ok", result)`` or ``("error", message)``; never blocks past ``timeout_s`` once started."""
        if self._process is None or not self._process.is_alive():
            if self._started:
                self.restarts += 1
            self._stop()
            self._start()
            self._started = True
        started = time.monotonic()
        try:
            self._conn.send(request)
            if not self._conn.poll(timeout_s):
                self._stop()
                return "error", f"timed out after {timeout_s:g} s"
            kind, detail = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            exit_code = None
            if self._process is not None:
                self._process.join(1.0)  # the pipe closes a moment before the exit status can be read
                exit_code = self._process.exitcode
            self._stop()
            return "error", (f"{self.what}'s process died (exit code {exit_code}) "
                             f"after {time.monotonic() - started:.1f} s")
        return ("ok", detail) if kind == "ok" else ("error", str(detail))

    def close(self) -> None:
        self._stop()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=self.target, args=(child, *self.args), daemon=True,
                                        name=f"rlctl-{self.what.split()[-1]}")
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            raise self.load_error(f"{self.label}: loading took more than {START_TIMEOUT_S:.0f} s")
        try:
            kind, detail = parent.recv()
        except EOFError:
            raise self.load_error(f"{self.label}: its process died while loading "
                                  f"(exit code {process.exitcode})") from None
        if kind != "ready":
            process.join(5)
            raise self.load_error(str(detail))
        self._process, self._conn = process, parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
