"""The Slurm state mapping: hardware faults never look like application failures."""

from __future__ import annotations

import pytest

from rlctl.backends.slurm_states import (
    JOB_STATES,
    JobOutcome,
    NodeHealth,
    map_job_state,
    map_node_state,
)


@pytest.mark.parametrize("state,outcome,reason", [
    ("PENDING", JobOutcome.PENDING, "slurm-pending"),
    ("RUNNING", JobOutcome.RUNNING, "slurm-running"),
    ("COMPLETING", JobOutcome.RUNNING, "slurm-completing"),
    ("COMPLETED", JobOutcome.SUCCEEDED, "exit-code-0"),
    ("NODE_FAIL", JobOutcome.HARDWARE_FAILED, "slurm-node-fail"),
    ("BOOT_FAIL", JobOutcome.HARDWARE_FAILED, "slurm-boot-fail"),
    ("PREEMPTED", JobOutcome.PREEMPTED, "slurm-preempted"),
    ("TIMEOUT", JobOutcome.TIMEOUT, "slurm-timeout"),
    ("CANCELLED", JobOutcome.CANCELLED, "slurm-cancelled"),
    ("CANCELLED by 0", JobOutcome.CANCELLED, "slurm-cancelled"),
    ("OUT_OF_MEMORY", JobOutcome.APP_FAILED, "out-of-memory"),
    ("SOMETHING_NEW", JobOutcome.UNKNOWN, "slurm-something_new"),
])
def test_job_state_table(state: str, outcome: JobOutcome, reason: str) -> None:
    verdict = map_job_state(state)
    assert (verdict.outcome, verdict.reason) == (outcome, reason)


def test_failed_with_exit_code_is_the_application() -> None:
    v = map_job_state("FAILED", exit_code=3, signal=0)
    assert v.outcome is JobOutcome.APP_FAILED and v.reason == "exit-code-3" and not v.hardware and v.terminal
    assert map_job_state("FAILED", exit_code=0, signal=9).reason == "signal-9"


def test_infrastructure_outcomes_are_hardware_not_app() -> None:
    for state in ("NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "TIMEOUT"):
        v = map_job_state(state, exit_code=1)
        assert v.hardware, state
        assert v.outcome is not JobOutcome.APP_FAILED, state


def test_every_table_entry_has_a_reason() -> None:
    for state, (outcome, reason, _terminal) in JOB_STATES.items():
        assert reason and isinstance(outcome, JobOutcome), state


@pytest.mark.parametrize("state,health", [
    ("IDLE", NodeHealth.HEALTHY),
    ("ALLOCATED", NodeHealth.HEALTHY),
    ("MIXED", NodeHealth.HEALTHY),
    ("idle", NodeHealth.HEALTHY),
    # seen in the lab: scontrol show node -o while slurmd was dead, before and after SlurmdTimeout
    ("ALLOCATED+NOT_RESPONDING", NodeHealth.UNREACHABLE),
    ("DOWN+NOT_RESPONDING", NodeHealth.DOWN),
    # sinfo %T spellings
    ("down*", NodeHealth.DOWN),
    ("idle*", NodeHealth.UNREACHABLE),
    ("drained", NodeHealth.DRAINED),
    ("draining", NodeHealth.DRAINED),
    ("IDLE+DRAIN", NodeHealth.DRAINED),
    ("DOWN+DRAIN", NodeHealth.DOWN),
    ("FAIL", NodeHealth.DOWN),
    ("FUTURE", NodeHealth.MAINTENANCE),
    ("IDLE+MAINTENANCE", NodeHealth.MAINTENANCE),
    ("UNKNOWN", NodeHealth.UNKNOWN),
])
def test_node_state_table(state: str, health: NodeHealth) -> None:
    assert map_node_state(state).health is health


def test_node_reachability() -> None:
    assert map_node_state("ALLOCATED").reachable
    assert not map_node_state("ALLOCATED+NOT_RESPONDING").reachable
    assert map_node_state("DOWN+NOT_RESPONDING").hardware_fault
    assert not map_node_state("IDLE+DRAIN").hardware_fault
