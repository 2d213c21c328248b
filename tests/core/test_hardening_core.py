"""The pure parts of hardening: fault-injection parameters, refused faults, controller downtime in
the ETTR ledger, the controller epoch."""

from __future__ import annotations

import math

import pytest

from rlctl.core.events import EventKind, event
from rlctl.core.faultparams import FaultParamError, validate_fault
from tests.core.test_policy import running_job


@pytest.mark.parametrize(("kind", "params", "option"), [
    ("hang", {"duration": -5}, "--duration"),
    ("hang", {"duration": 0}, "--duration"),
    ("slow", {"after": -3, "duration": 1}, "--after"),
    ("slow", {"duration": math.inf}, "--duration"),
    ("slow", {"duration": math.nan}, "--duration"),
    ("slow", {"factor": 1.0}, "--factor"),
    ("slow", {"factor": 1e6}, "--factor"),
    ("xid", {"code": -1}, "--code"),
    ("xid", {"code": 0}, "--code"),
    ("xid", {"code": 100_000}, "--code"),
    ("xid", {"code": 7.5}, "--code"),
    ("xid", {}, "--code"),
    ("xid", {"code": True}, "--code"),
    ("ecc", {"kind": "triple"}, "--ecc"),
    ("crash", {"duration": 4}, "--duration"),
    ("crash", {"after": "soon"}, "--after"),
    ("crash", {"after": 1e309}, "--after"),
    ("partition", {"duration": 1e12}, "--duration"),
    ("meteor", {}, "--kind"),
])
def test_bad_fault_parameters_are_refused_naming_the_option(kind: str, params: dict, option: str) -> None:
    with pytest.raises(FaultParamError) as refused:
        validate_fault(kind, params)
    assert refused.value.option.startswith(option), str(refused.value)
    assert str(refused.value).startswith(option)


def test_good_fault_parameters_are_normalised() -> None:
    assert validate_fault("xid", {"code": 79.0, "after": 0}) == {"code": 79, "after": 0.0}
    assert validate_fault("slow", {"factor": 4, "duration": 30}) == {"factor": 4.0, "duration": 30.0}
    assert validate_fault("hang", {"duration": None}) == {}


def test_a_refused_fault_is_closed_and_never_credited_with_a_later_verdict() -> None:
    model = running_job(spares=0)
    model.apply(event(EventKind.FAULT_INJECTED, 5.0, fault_id="inj-1", node="node02", kind="hang",
                      params={"duration": 5}))
    assert [f.fault_id for f in model.open_faults()] == ["inj-1"]
    model.apply(event(EventKind.FAULT_REFUSED, 5.1, fault_id="inj-1", node="node02", reason="agent refused"))
    assert model.open_faults() == []
    model.apply(event(EventKind.VERDICT, 9.0, node="node02", slot="rollout-0", verdict="failed", fault="inj-1",
                      fault_kind="worker-crash", reason="exit", action="restart-worker"))
    refused = model.faults["inj-1"]
    assert refused.detected_at is None and refused.refused == "agent refused"
    credited = [f for f in model.faults.values() if f.detected_at == 9.0]
    assert len(credited) == 1 and credited[0] is not refused and credited[0].verdict == "worker-crash"


def test_time_without_a_controller_is_its_own_ledger_category_never_productive() -> None:
    model = running_job(spares=0)
    for state in ("starting", "running"):
        model.apply(event(EventKind.JOB_STATE_CHANGED, 2.0, state=state, reason="test"))
    model.apply(event(EventKind.WEIGHTS_PUBLISHED, 3.0, version=1, slot="trainer-0", source={"host": "h", "port": 1}))
    model.apply(event(EventKind.HEARTBEAT_SUMMARY, 10.0, beats=1, nodes=4, window_s=5.0))
    productive_before = model.ledger.seconds["productive"]
    model.apply(event(EventKind.CONTROLLER_STARTED, 26.0, pid=2, resumed=True, agent_port=1, epoch=2))
    assert model.ledger.seconds["controller"] == pytest.approx(16.0)
    assert model.ledger.seconds["productive"] == pytest.approx(productive_before)
    assert model.controller_epoch == 2


def test_the_epoch_counts_controller_starts_in_journals_that_do_not_name_it() -> None:
    model = running_job(spares=0)
    model.apply(event(EventKind.CONTROLLER_STARTED, 2.0, pid=1, resumed=False))
    model.apply(event(EventKind.CONTROLLER_STARTED, 3.0, pid=2, resumed=True))
    assert model.controller_epoch == 2
