"""Static checks with the settings in pyproject.toml: mypy over ``rlctl`` and the agent, ruff (the
version pinned in the dev extra) over the code, the tests and the benchmarks."""

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


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the dev extra")
    from ruff.__main__ import find_ruff_bin

    result = subprocess.run([find_ruff_bin(), "check", "--no-cache", "rlctl", "agents", "tests", "bench"], cwd=ROOT,
                            capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
