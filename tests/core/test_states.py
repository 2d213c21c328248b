"""Lifecycle tables: legal paths pass, illegal edges raise, history records every move."""

from __future__ import annotations

import pytest

from rlctl.core.states import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    WORKER_TRANSITIONS,
    IllegalTransition,
    JobState,
    Lifecycle,
    NodeState,
    WorkerState,
)


def test_node_happy_path_and_spare_path() -> None:
    life = Lifecycle.begin(NodeState.ALLOCATING, 0.0, "asked")
    for i, state in enumerate([NodeState.STARTING, NodeState.READY, NodeState.ACTIVE, NodeState.SUSPECT,
                               NodeState.FAILED, NodeState.DRAINING, NodeState.RELEASED], start=1):
        life.move(state, float(i), "test")
    assert [t.state for t in life.history][-1] == NodeState.RELEASED
    assert len(life.history) == 8
    spare = Lifecycle.begin(NodeState.READY, 0.0, "registered")
    spare.move(NodeState.STANDBY, 1.0, "spare")
    spare.move(NodeState.ACTIVE, 2.0, "took over")


def test_illegal_transitions_raise() -> None:
    with pytest.raises(IllegalTransition):
        Lifecycle.begin(NodeState.RELEASED, 0.0, "done").move(NodeState.ACTIVE, 1.0, "resurrect")
    with pytest.raises(IllegalTransition):
        Lifecycle.begin(WorkerState.EXITED, 0.0, "done").move(WorkerState.RUNNING, 1.0, "zombie")
    with pytest.raises(IllegalTransition):
        Lifecycle.begin(JobState.SUCCEEDED, 0.0, "done").move(JobState.RUNNING, 1.0, "again")


@pytest.mark.parametrize("table", [NODE_TRANSITIONS, WORKER_TRANSITIONS, JOB_TRANSITIONS])
def test_every_state_has_a_row_and_every_edge_a_reason(table: dict) -> None:
    states = set(type(next(iter(table))))
    assert set(table) == states
    for edges in table.values():
        for target, reason in edges.items():
            assert target in states and reason.strip()


def test_terminal_job_states_have_no_exit() -> None:
    for state in JobState:
        assert state.terminal == (not JOB_TRANSITIONS[state])
