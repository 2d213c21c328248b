"""Runs last in tests/lab: ``rlctl lab down`` leaves nothing behind (skip with RLCTL_LAB_KEEP=1)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import LAB_DIR, LAB_NODES

from rlctl import lab

pytestmark = pytest.mark.lab


def test_cli_status_json(lab_status: lab.LabStatus) -> None:
    from typer.testing import CliRunner

    from rlctl.cli.lab import lab_app

    result = CliRunner().invoke(lab_app, ["status", "--json", "--state-dir", str(LAB_DIR)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output.strip().splitlines()[-1])
    assert payload["ok"] and payload["controller_address"] == "10.213.0.1"
    assert [n["name"] for n in payload["nodes"]] == [f"node{i:02d}" for i in range(1, LAB_NODES + 1)]


@pytest.mark.skipif(os.environ.get("RLCTL_LAB_KEEP") == "1", reason="RLCTL_LAB_KEEP=1 keeps the lab up")
def test_lab_down_leaves_nothing(lab_status: lab.LabStatus) -> None:
    from typer.testing import CliRunner

    from rlctl.cli.lab import lab_app

    result = CliRunner().invoke(lab_app, ["down", "--json", "--state-dir", str(LAB_DIR)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["clean"] is True
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "rlctl-" not in netns
    assert subprocess.run(["ip", "link", "show", "rlctlbr0"], capture_output=True, check=False).returncode != 0
    with open("/etc/hosts") as fh:
        assert "rlctl-lab" not in fh.read()
    assert not LAB_DIR.exists()
    with open("/proc/self/mountinfo") as fh:
        assert str(LAB_DIR) not in fh.read()
    assert subprocess.run(["id", "-u", "rlctl-lab"], capture_output=True, check=False).returncode != 0
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(LAB_DIR) not in procs, [line for line in procs.splitlines() if str(LAB_DIR) in line]
    assert not lab.status(state_dir=LAB_DIR).up
