"""The package type-checks: mypy over ``rlctl`` and the agent, with the settings in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_mypy_finds_no_errors(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy comes with the dev extra")
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "rlctl",
                             "agents/rlctl_agent"], cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
