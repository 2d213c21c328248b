"""Suite-wide rules: how the suite shares two xdist workers, and Hypothesis without wall-clock limits.

``scripts/test.sh`` runs pytest with ``-n 2``. Tests that run real processes against time bounds
(whole jobs in integration, chaos, the lab cluster and the GPU check's CPU twin; agents, weight
servers, the controller's hub, the telemetry endpoint) form one work unit: xdist runs it on one
worker, one test at a time, in the same order as a serial run. Every other test is pure
computation (the core, the simulator, the workload on torch, static checks) and goes with its
module to whichever worker is free, beside the timed unit. A plain ``pytest`` (no ``-n``) runs
everything in order, as before.

Agents and weight servers once ran as a second unit beside the jobs: a clean run then closed 7 of
8 strangers within a weight server's bound (``test_strangers_beyond_the_cap_are_closed_at_once``),
so every timed test shares the one unit.

The units come from a scheduler of our own rather than ``xdist_group`` marks: with pytest 9.2,
xdist 3.8's ``--dist loadgroup`` no longer sees the marks (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from typing import Any

import pytest

TIMED_UNIT = "timed"
# Top-level test folders whose tests start processes, sockets or jobs and assert on how fast
# something happens; the folders not named here are split by module.
TIMED_FOLDERS = frozenset({"integration", "chaos", "lab", "gpu", "agent", "weights", "controller", "observe",
                           "backends"})
# The folders whose modules are units of their own (pure computation, or quick CLI calls with no
# time bound). A new folder of tests goes in one of the two sets (tests/static/test_work_units.py).
MODULE_FOLDERS = frozenset({"cli", "core", "sim", "static", "workload", "vllm_engine"})

try:
    from hypothesis import settings
except ImportError:  # the vLLM tier's venv runs only tests/vllm_engine, without Hypothesis
    pass
else:
    # A Hypothesis example that runs slower because the other worker is busy is not a failure.
    settings.register_profile("suite", deadline=None)
    settings.load_profile("suite")


def work_unit_of(nodeid: str) -> str:
    """The xdist work unit of the test ``nodeid`` (``tests/<folder>/<module>.py::<name>``): the
    timed unit, or the test's module."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIMED_FOLDERS:
        return TIMED_UNIT
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class TimedUnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (largest unit first, each unit on one worker) over our units."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit_of(nodeid)

    return TimedUnitScheduling(config, log)
