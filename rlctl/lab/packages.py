"""Debian packages the lab needs, and installing the missing ones (root only).

There is no init system in the sandboxes this runs in, so a temporary ``policy-rc.d`` stops
package scripts from trying to start system daemons; the lab starts its own, privately.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlctl.lab.shell import LabError, run

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "openssh-server", "openssh-client", "iproute2")
POLICY_RC = Path("/usr/sbin/policy-rc.d")
APT_LOCK_WAIT = ["-o", "DPkg::Lock::Timeout=300"]


def missing_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Packages dpkg does not report as installed."""
    missing = []
    for pkg in packages:
        proc = run(["dpkg-query", "-W", "-f=${Status}", pkg], check=False)
        if "ok installed" not in proc.stdout:
            missing.append(pkg)
    return missing


def install_packages(packages: list[str]) -> None:
    """apt-get install ``packages`` (no recommends), retrying once after an ``apt-get update``."""
    if not packages:
        return
    made_policy = not POLICY_RC.exists()
    if made_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        if not list(Path("/var/lib/apt/lists").glob("*_Packages*")):
            run(["apt-get", *APT_LOCK_WAIT, "update", "-q"], timeout=600, env=env)
        argv = ["apt-get", *APT_LOCK_WAIT, "install", "-y", "-q", "--no-install-recommends", *packages]
        if run(argv, check=False, timeout=900, env=env).returncode != 0:
            run(["apt-get", *APT_LOCK_WAIT, "update", "-q"], timeout=600, env=env)
            run(argv, timeout=900, env=env)
    except LabError as exc:
        raise LabError(f"installing {' '.join(packages)} failed: {exc}") from exc
    finally:
        if made_policy:
            POLICY_RC.unlink(missing_ok=True)


def ensure_packages(install: bool = True) -> list[str]:
    """Install what is missing (when ``install``); returns what was installed. Raises if still missing."""
    missing = missing_packages()
    if missing and not install:
        raise LabError(f"missing Debian packages: {' '.join(missing)} (run as root to install them)")
    install_packages(missing)
    return missing
