"""`rlctl stop`'s flags: a bad ``--timeout`` or ``--timeout`` with ``--now`` is refused by name, with
exit code 2, before any job is touched (the stop itself is tested in
tests/integration/test_stop_checkpoint_job.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("flags", "said"), [
    (["--timeout", "0"], "--timeout: expected seconds in [1, 86400], got 0"),
    (["--timeout", "1e6"], "--timeout: expected seconds in [1, 86400], got 1e+06"),
    (["--now", "--timeout", "5"], "--timeout: --now writes no checkpoint"),
])
def test_bad_stop_flags_are_refused_by_name(tmp_path: Path, flags: list[str], said: str) -> None:
    result = subprocess.run([sys.executable, "-m", "rlctl.cli", "stop", "somejob", *flags],
                            env={"RLCTL_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert not any(tmp_path.iterdir())
