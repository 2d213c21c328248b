"""Suite-wide rules: how the suite shares two xdist workers, and Hypothesis without wall-clock limits.

``scripts/test.sh`` runs pytest with ``-n 2``. Tests that run real processes against time bounds
form two work units, each run on one worker, one test at a time, as a serial run would:

- ``jobs``: whole jobs (integration, chaos, the lab cluster, the GPU check's CPU twin). No two
  ever run at once: each job's detection bounds assume it has the machine's spare cores.
- ``processes``: agents, weight servers, the controller's hub, the telemetry endpoint. They may run
  beside a job, as they run beside each other on a real node.

Every other test is pure computation (the core, the simulator, the workload on torch, static
checks) and goes with its module to whichever worker is free. A plain ``pytest`` (no ``-n``) runs
everything in order, as before.

The units come from a scheduler of our own rather than ``xdist_group`` marks: with pytest 9.2,
xdist 3.8's ``--dist loadgroup`` no longer sees the marks (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from typing import Any

import pytest

# Top-level test folder → its unit; the folders not named here are split by module.
TIMED_UNITS = {
    **dict.fromkeys(("integration", "chaos", "lab", "gpu"), "jobs"),
    **dict.fromkeys(("agent", "weights", "controller", "observe", "backends"), "processes"),
}

try:
    from hypothesis import settings
except ImportError:  # the vLLM tier's venv runs only tests/vllm_engine, without Hypothesis
    pass
else:
    # A Hypothesis example that runs slower because the other worker is busy is not a failure.
    settings.register_profile("suite", deadline=None)
    settings.load_profile("suite")


def work_unit_of(nodeid: str) -> str:
    """The xdist work unit of the test ``nodeid`` (``tests/<folder>/<module>.py::<name>``): one of
    the timed units, or the test's module."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIMED_UNITS:
        return TIMED_UNITS[parts[1]]
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class TimedUnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (largest unit first, each unit on one worker) over our units."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit_of(nodeid)

    return TimedUnitScheduling(config, log)
