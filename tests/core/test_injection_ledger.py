"""Injections in the job model and the ETTR ledger: a refused or cancelled injection costs the job
nothing; an injection counts from when its agent carried it out (or a verdict saw it); the book of
injections (``--list``) follows every state from the journal's events."""

from __future__ import annotations

import pytest

from rlctl.core.events import Event, EventKind, event
from rlctl.core.injections import InjectionState, book_of
from rlctl.core.model import JobModel
from tests.core.test_policy import running_job


def productive_job() -> JobModel:
    model = running_job(spares=0)
    for state in ("starting", "running"):
        model.apply(event(EventKind.JOB_STATE_CHANGED, 2.0, state=state, reason="test"))
    model.apply(event(EventKind.WEIGHTS_PUBLISHED, 3.0, version=1, slot="trainer-0", source={"host": "h", "port": 1}))
    return model


def beat(model: JobModel, at: float) -> None:
    model.apply(event(EventKind.HEARTBEAT_SUMMARY, at, beats=1, nodes=4, window_s=5.0))


def injected(at: float, awaiting: bool = True) -> Event:
    return event(EventKind.FAULT_INJECTED, at, fault_id="inj-1", node="node01", kind="hang", params={},
                 **({"awaiting_answer": True} if awaiting else {}))


def test_a_refused_injection_adds_nothing_to_the_ledger() -> None:
    model = productive_job()
    model.apply(injected(10.0))
    beat(model, 10.5)  # the agent takes its time to answer; the ledger moves on meanwhile
    model.apply(event(EventKind.FAULT_REFUSED, 11.0, fault_id="inj-1", node="node01", reason="no live worker"))
    beat(model, 20.0)
    assert model.ledger.seconds["detection"] == 0.0 and model.ledger.seconds["recovery"] == 0.0
    assert model.ledger.seconds["productive"] == pytest.approx(17.0)
    assert model.open_faults() == []


def test_an_injection_counts_from_when_its_agent_carried_it_out() -> None:
    model = productive_job()
    model.apply(injected(10.0))
    beat(model, 10.5)
    assert model.ledger.seconds["detection"] == 0.0
    model.apply(event(EventKind.FAULT_ACCEPTED, 11.0, fault_id="inj-1", node="node01"))
    beat(model, 20.0)
    assert model.ledger.seconds["detection"] == pytest.approx(9.0)  # the trainer: the whole job's progress


def test_a_verdict_before_the_agents_answer_sees_the_injection_and_it_counts_from_then() -> None:
    model = productive_job()
    model.apply(injected(10.0))
    model.apply(event(EventKind.VERDICT, 10.2, node="node01", slot="trainer-0", verdict="failed", fault="inj-1",
                      fault_kind="worker-hang", reason="no progress", action="restart-worker"))
    fault = model.faults["inj-1"]
    assert fault.detected_at == 10.2 and not fault.awaiting_answer
    model.apply(event(EventKind.FAULT_ACCEPTED, 10.3, fault_id="inj-1", node="node01"))
    beat(model, 20.0)
    assert model.ledger.seconds["detection"] == 0.0
    assert model.ledger.seconds["recovery"] == pytest.approx(9.8)


def test_a_journal_from_before_answers_were_journaled_counts_the_injection_at_once() -> None:
    model = productive_job()
    model.apply(injected(10.0, awaiting=False))
    beat(model, 20.0)
    assert model.ledger.seconds["detection"] == pytest.approx(10.0)
    assert book_of([injected(10.0, awaiting=False)]).injections["inj-1"].state == InjectionState.CARRIED_OUT


def test_a_delayed_injection_is_no_fault_until_carried_out_and_a_cancelled_one_never_is() -> None:
    model = productive_job()
    events = [
        event(EventKind.FAULT_SCHEDULED, 5.0, fault_id="inj-1", node="node01", kind="crash", params={}, due_at=100.0),
        event(EventKind.FAULT_SCHEDULED, 6.0, fault_id="inj-2", node="node02", kind="hang", params={}, due_at=30.0),
        event(EventKind.FAULT_CANCELLED, 50.0, fault_id="inj-1", node="node01", reason="cancelled by the operator"),
        event(EventKind.FAULT_INJECTED, 30.0, fault_id="inj-2", node="node02", kind="hang", params={},
              awaiting_answer=True),
    ]
    book = book_of(events[:2])
    assert [i.state for i in book.injections.values()] == [InjectionState.PENDING] * 2
    assert [i.fault_id for i in book.pending()] == ["inj-1", "inj-2"]
    for ev in sorted(events, key=lambda e: e.at):
        model.apply(ev)
        book.apply(ev)
    beat(model, 200.0)
    assert "inj-1" not in model.faults, "a cancelled injection never became a fault"
    assert book.injections["inj-1"].state == InjectionState.CANCELLED
    assert book.injections["inj-1"].reason == "cancelled by the operator"
    assert book.injections["inj-2"].state == InjectionState.INJECTING
    assert model.ledger.seconds["detection"] == 0.0, "nothing counts before the agent answered"
    refused = event(EventKind.FAULT_REFUSED, 30.1, fault_id="inj-2", node="node02", reason="agent refused")
    book.apply(refused)
    assert book.injections["inj-2"].state == InjectionState.REFUSED and book.injections["inj-2"].settled_at == 30.1
    assert book.pending() == []


def test_a_listing_shows_what_is_unsettled_and_the_last_settled_ones() -> None:
    events = []
    for n in range(30):
        events.append(event(EventKind.FAULT_INJECTED, float(n), fault_id=f"inj-{n}", node="node01", kind="crash",
                            params={}, awaiting_answer=True))
        events.append(event(EventKind.FAULT_ACCEPTED, n + 0.1, fault_id=f"inj-{n}", node="node01"))
    events.append(event(EventKind.FAULT_SCHEDULED, 40.0, fault_id="inj-later", node="node01", kind="crash", params={},
                        due_at=1000.0))
    listed = [i.fault_id for i in book_of(events).listing(recent=5)]
    assert listed == [f"inj-{n}" for n in range(25, 30)] + ["inj-later"]
