"""Helpers the benchmarks that drive real local jobs share: the CLI in a subprocess, and waiting."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any


def rlctl(env: dict[str, str], *args: str) -> str:
    """``python -m rlctl.cli ARGS`` with ``env``; its stdout, or RuntimeError with its stderr."""
    result = subprocess.run([sys.executable, "-m", "rlctl.cli", *args], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"rlctl {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result.stdout


def wait_until(what: str, check: Any, timeout: float = 300.0) -> Any:
    """The first truthy ``check()``, polled every 0.5 s; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")
