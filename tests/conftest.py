"""Suite-wide rules: how the suite shares two xdist workers, and Hypothesis without wall-clock limits.

``scripts/test.sh`` runs pytest with ``-n 2``. Whole jobs (integration, chaos, the lab cluster
and the GPU check's CPU twin) form one work unit: xdist runs it on one worker, one test at a time,
in the same order as a serial run, so no two jobs ever share the machine. Every other test goes
with its module to whichever worker is free, beside the jobs: pure computation (the core, the
simulator, the workload on torch, static checks) and single processes with their own time bounds
(agents, weight servers, the controller's hub, the telemetry endpoint). A plain ``pytest`` (no
``-n``) runs everything in order, as before.

Agents and weight servers once shared the jobs' unit, after a run beside a job closed 7 of 8
strangers within a weight server's bound (``test_strangers_beyond_the_cap_are_closed_at_once``,
since fixed at its root: the test read the closes before the holder had made them). The jobs'
unit was then the whole run's length (1,034 s of tests against 405 s on the other worker).

The units come from a scheduler of our own rather than ``xdist_group`` marks: with pytest 9.2,
xdist 3.8's ``--dist loadgroup`` no longer sees the marks (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from typing import Any

import pytest

TIMED_UNIT = "timed"
# Top-level test folders whose tests run whole jobs (a controller, agents and workers) against time
# bounds: one at a time, never two jobs at once.
TIMED_FOLDERS = frozenset({"integration", "chaos", "lab", "gpu"})
# The folders whose modules are units of their own: pure computation, quick CLI calls, and single
# processes (an agent, a weight server, the hub) beside one job at most. A new folder of tests goes
# in one of the two sets (tests/static/test_work_units.py).
MODULE_FOLDERS = frozenset({"cli", "core", "sim", "static", "workload", "vllm_engine", "agent", "weights",
                            "controller", "observe", "backends"})

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
