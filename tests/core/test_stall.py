"""The stall guard on its own: a job whose version and faults do not move for ``stall_s`` is judged
stalled once, naming its last progress; a new version or a new fault starts the clock again; 0
turns it off; a job that is not starting, running or recovering is never judged."""

from __future__ import annotations

from rlctl.core.events import EventKind, event
from rlctl.core.model import JobModel
from rlctl.core.stall import StallGuard
from tests.core.test_policy import running_job


def running() -> JobModel:
    model = running_job()
    for state in ("starting", "running"):
        model.apply(event(EventKind.JOB_STATE_CHANGED, 2.0, state=state, reason="test"))
    return model


def test_a_job_that_moves_nothing_for_stall_s_is_stalled_naming_its_last_progress() -> None:
    model = running()
    guard = StallGuard(100.0)
    assert guard.check(model, 10.0) is None  # the first look starts the clock
    assert guard.check(model, 109.0) is None
    stalled = guard.check(model, 110.0)
    assert stalled is not None
    assert [e.type for e in stalled.events] == [EventKind.JOB_STALLED]
    assert stalled.events[0].data == {"since_version": 0, "seconds": 100.0}
    assert stalled.reason.startswith("failed: stalled: no step trained and no fault met for 100 s")
    assert "stall_s = 100" in stalled.reason and "v0 (0/10 steps)" in stalled.reason


def test_a_new_version_or_a_new_fault_starts_the_clock_again() -> None:
    model = running()
    guard = StallGuard(100.0)
    guard.check(model, 0.0)
    model.published_version = 1
    assert guard.check(model, 90.0) is None
    assert guard.check(model, 180.0) is None  # 90 s since v1
    model.apply(event(EventKind.FAULT_INJECTED, 185.0, fault_id="inj-1", node="node02", kind="crash", params={}))
    assert guard.check(model, 189.0) is None
    assert guard.check(model, 288.0) is None
    assert guard.check(model, 289.0) is not None


def test_zero_turns_it_off_and_an_ended_job_is_never_judged() -> None:
    model = running()
    off = StallGuard(0.0)
    assert off.check(model, 0.0) is None and off.check(model, 1e9) is None
    guard = StallGuard(10.0)
    guard.check(model, 0.0)
    model.apply(event(EventKind.JOB_STATE_CHANGED, 5.0, state="stopping", reason="test"))
    assert guard.check(model, 100.0) is None
    assert guard.mark is None
