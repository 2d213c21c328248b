"""Fixtures for the lab tests: a real 4-node Slurm + sshd lab (root only), reused when already up.

Environment: RLCTL_LAB_DIR (default /var/lib/rlctl-lab), RLCTL_LAB_KEEP=1 keeps the lab after the
session (the final test otherwise takes it down and checks that nothing is left).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlctl import lab
from rlctl.lab.packages import missing_packages

LAB_DIR = Path(os.environ.get("RLCTL_LAB_DIR", str(lab.DEFAULT_STATE_DIR)))
LAB_NODES = 6  # the job tests need 6; one lab serves every lab test
LAB_GPUS = 2


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "lab tests need root (network namespaces, a bridge, slurm daemons)"
    if missing_packages() and shutil.which("apt-get") is None:
        return f"lab tests need Debian packages {missing_packages()} and apt-get is not available to install them"
    return None


@pytest.fixture(scope="session")
def lab_status() -> Iterator[lab.LabStatus]:
    """The lab, brought up (or reused) once per session."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    current = lab.status(state_dir=LAB_DIR)
    cfg = lab.LabConfig.load(LAB_DIR)
    if not (current.up and cfg and cfg.nodes == LAB_NODES and cfg.gpus_per_node == LAB_GPUS):
        try:
            current = lab.up(LAB_NODES, LAB_GPUS, state_dir=LAB_DIR)
        except lab.LabError as exc:
            pytest.skip(f"could not bring the lab up: {exc}")
    yield current


@pytest.fixture
def healthy_lab(lab_status: lab.LabStatus) -> lab.LabStatus:
    """Every node repaired and idle before the test (faults of earlier tests undone)."""
    for node in lab_status.nodes:
        lab.heal(node.name, state_dir=LAB_DIR)
        lab.node_up(node.name, state_dir=LAB_DIR)
    from rlctl.lab.slurm import wait_all_idle

    cfg = lab.LabConfig.load(LAB_DIR)
    assert cfg is not None
    wait_all_idle(cfg, 90)
    return lab.status(state_dir=LAB_DIR)
