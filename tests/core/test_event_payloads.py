"""The journal's schema (rlctl.core.event_payloads): one frozen dataclass per event kind, the typed view
of an event (``Event.payload``, ``Event.as_``), what a new event may hold and what a journal row read
back may, and a journal written before the schema existed reading back to the same job model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from rlctl.core.event_payloads import (
    PAYLOADS,
    SCHEMAS,
    EventPayload,
    NodeStateChangedData,
    TrainerRestoredData,
    VerdictData,
    WorkerExitedData,
    WorkerPhaseData,
)
from rlctl.core.events import Event, EventError, EventKind, event
from rlctl.core.model import JobModel
from rlctl.core.snapshot import snapshot
from rlctl.sim.calibrate import replay
from rlctl.spec_loader import load_job_file

SIM_DATA = Path(__file__).resolve().parents[1] / "sim" / "data"
# The job model's status snapshot after replaying chaos_journal.jsonl, computed before the schema existed
# (when handlers read the raw data): the typed view must rebuild exactly the same job.
SNAPSHOT_BEFORE = Path(__file__).resolve().parent / "data" / "chaos_journal_snapshot.json"

# The keys each kind required before the payload dataclasses (the table ``rlctl.core.events.EVENT_TYPES``).
OLD_REQUIRED: dict[EventKind, tuple[str, ...]] = {
    EventKind.JOB_SUBMITTED: ("job_id", "spec_file", "backend", "policy"),
    EventKind.JOB_STATE_CHANGED: ("state", "reason"),
    EventKind.NODE_ALLOCATED: ("node", "host", "role", "slot"),
    EventKind.NODE_STATE_CHANGED: ("node", "state", "reason"),
    EventKind.AGENT_REGISTERED: ("node", "incarnation", "facts"),
    EventKind.AGENT_DISCONNECTED: ("node", "reason"),
    EventKind.HEARTBEAT_SUMMARY: ("beats", "nodes", "window_s"),
    EventKind.WORKER_STARTING: ("slot", "wid", "node", "role"),
    EventKind.WORKER_STARTED: ("slot", "wid", "pid"),
    EventKind.WORKER_PHASE: ("slot", "wid", "phase", "step"),
    EventKind.WORKER_EXITED: ("slot", "wid", "exit_code", "signal"),
    EventKind.FAULT_INJECTED: ("fault_id", "node", "kind", "params"),
    EventKind.FAULT_REFUSED: ("fault_id", "node", "reason"),
    EventKind.FAULT_SCHEDULED: ("fault_id", "node", "kind", "params", "due_at"),
    EventKind.FAULT_ACCEPTED: ("fault_id", "node"),
    EventKind.FAULT_CANCELLED: ("fault_id", "node", "reason"),
    EventKind.CONNECTION_REFUSED: ("source", "node", "reason", "count"),
    EventKind.FAULT_SIGNAL: ("node", "kind", "detail"),
    EventKind.VERDICT: ("node", "slot", "verdict", "fault", "reason"),
    EventKind.ACTION_TAKEN: ("action", "node", "slot", "reason"),
    EventKind.FAULT_RECOVERED: ("fault_ids", "slot", "node"),
    EventKind.ROUND_STARTED: ("step", "kind", "weights_version", "max_new_tokens", "prompts", "target_groups"),
    EventKind.ROUND_EXTENDED: ("step", "prompts"),
    EventKind.ITEMS_DISPATCHED: ("slot", "wid", "item_ids"),
    EventKind.ITEMS_RETURNED: ("item_ids", "reason"),
    EventKind.TRAJECTORY_STORED: ("item_id", "response_tokens", "truncated", "weights_version", "slot"),
    EventKind.PROMPT_DEFERRED: ("prompt_id", "step"),
    EventKind.REWARDS_STORED: ("scores",),
    EventKind.REWARD_FUNCTION_FAILED: ("function", "item_id", "prompt_id", "error", "on_error"),
    EventKind.REWARD_FUNCTION_FAILING: ("function", "failures", "calls", "consecutive", "last_error", "reason"),
    EventKind.REWARD_FUNCTION_RECOVERED: ("function", "failures", "calls", "reason"),
    EventKind.ENV_FAILED: ("item_id", "turn", "slot", "error", "action"),
    EventKind.SCORING_DISPATCHED: ("slot", "wid", "item_ids"),
    EventKind.BATCH_FORMED: ("step", "kind", "prompt_ids", "returned_prompt_ids"),
    EventKind.EPOCH_STARTED: ("epoch", "order"),
    EventKind.WEIGHTS_PUBLISHED: ("version", "slot", "source"),
    EventKind.WEIGHTS_HELD: ("version", "slot", "source"),
    EventKind.WEIGHTS_SOURCE_FAILED: ("version", "source", "reporter", "error"),
    EventKind.WEIGHTS_SLOWER_LANE: ("slot", "version", "lane", "faster_lane", "same_node", "gbps", "reason"),
    EventKind.STEP_TRAINED: ("step", "metrics"),
    EventKind.CHECKPOINTED: ("step", "path"),
    EventKind.CHECKPOINT_REJECTED: ("step", "path", "file", "reason"),
    EventKind.CHECKPOINT_FAILED: ("step", "path", "error"),
    EventKind.TRAINER_RESTORED: ("slot", "checkpoint_step", "replayed_steps"),
    EventKind.TRAINER_STATE_HELD: ("slot", "wid", "step", "source"),
    EventKind.CONTROLLER_STARTED: ("pid", "resumed"),
    EventKind.SCHEDULER_ROLLED_BACK: ("to_step",),
    EventKind.HELD_OUT_STARTED: ("version", "prompts", "max_new_tokens"),
    EventKind.HELD_OUT_SCORED: ("version", "prompts", "reward_mean", "reward_std_err", "accuracy"),
    EventKind.HEARTBEAT: ("node",),
    EventKind.ENGINE_RESIZED: ("slot", "wid", "tensor_parallel", "gpus", "seconds"),
    EventKind.JOB_STALLED: ("since_version", "seconds"),
    EventKind.STOP_CHECKPOINT: ("outcome", "step", "checkpoint_step", "seconds", "timeout_s", "reason"),
}

SAMPLE_OF_TYPE: dict[type, Any] = {str: "x", int: 3, float: 2.5, bool: True, list: [], dict: {}, type(None): None}


def sample_data(kind: EventKind) -> dict[str, Any]:
    """Data for ``kind`` with every field set (optional ones included), each to a value of its type."""
    schema = SCHEMAS[kind]
    return {name: SAMPLE_OF_TYPE[schema.accepts[name][0]] for name in schema.fields}


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def from_journal_row(row: dict[str, Any]) -> Event:
    """The event a journal's row holds, read as ``Journal.read`` reads it (the exported row's data, as stored)."""
    stored = json.dumps({"v": 1, "data": row["data"]}, separators=(",", ":"))
    return Event.from_row(int(row["seq"]), row["type"], float(row["at"]), stored)


def test_every_kind_has_one_frozen_payload_dataclass() -> None:
    assert set(PAYLOADS) == set(EventKind)
    for kind, payload in PAYLOADS.items():
        assert payload.KIND == kind and issubclass(payload, EventPayload)
        assert dataclasses.is_dataclass(payload) and payload.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert payload.__name__ == f"{kind.value}Data"


def test_the_required_fields_are_the_keys_each_kind_required_before() -> None:
    assert set(OLD_REQUIRED) == set(EventKind)
    for kind, keys in OLD_REQUIRED.items():
        assert SCHEMAS[kind].required == keys, kind


def test_every_field_has_a_json_type() -> None:
    for kind, schema in SCHEMAS.items():
        assert set(schema.accepts) == set(schema.fields), f"{kind}: a field typed Any"
        assert all(tuple not in accepted for accepted in schema.accepts.values()), kind


def test_an_event_missing_a_required_key_is_refused_naming_the_event_and_the_key() -> None:
    with pytest.raises(EventError, match="event Verdict lacks slot, verdict, fault, reason"):
        event(EventKind.VERDICT, 0.0, node="n")
    with pytest.raises(EventError, match="unknown event type"):
        Event(type="NoSuchEvent", at=0.0)  # type: ignore[arg-type]


def test_a_new_event_with_a_key_its_kind_has_no_field_for_is_refused() -> None:
    with pytest.raises(EventError, match="event WorkerPhase has no field stpe"):
        event(EventKind.WORKER_PHASE, 1.0, slot="rollout-0", wid="rollout-0.1", phase="loading", stpe=3)
    with pytest.raises(EventError, match="has no field stpe"):
        Event(type=EventKind.WORKER_PHASE, at=1.0, data={"slot": "s", "wid": "w", "phase": "p", "step": 1, "stpe": 3})


def test_a_value_of_the_wrong_json_type_is_refused() -> None:
    with pytest.raises(EventError, match="step="):
        Event.of(1.0, WorkerPhaseData(slot="rollout-0", wid="w", phase="loading", step="3"))  # type: ignore[arg-type]
    with pytest.raises(EventError, match="step=True"):
        event(EventKind.WORKER_PHASE, 1.0, slot="s", wid="w", phase="p", step=True)  # a bool is no int
    with pytest.raises(EventError, match="replayed_steps="):
        event(EventKind.TRAINER_RESTORED, 1.0, slot="trainer-0", checkpoint_step=None, replayed_steps=(1, 2))
    ok = event(EventKind.JOB_STALLED, 1.0, since_version=2, seconds=100)  # an int is a float (JSON writes 100)
    assert ok.payload == ok.as_(type(ok.payload))


def test_a_journal_row_keeps_a_key_its_kind_no_longer_has_and_the_typed_view_leaves_it_out() -> None:
    data = {"node": "node01", "state": "ready", "reason": "agent registered", "retired_key": [1, 2]}
    ev = Event.from_row(7, "NodeStateChanged", 3.0, json.dumps({"v": 1, "data": data}))
    assert ev.data == data and json.loads(ev.to_json())["data"] == data
    assert ev.as_(NodeStateChangedData) == NodeStateChangedData(node="node01", state="ready", reason="agent registered")
    with pytest.raises(EventError, match="lacks reason"):
        Event.from_row(8, "NodeStateChanged", 3.0, json.dumps({"v": 1, "data": {"node": "n", "state": "ready"}}))


def test_a_journal_row_with_a_value_an_earlier_version_typed_otherwise_reads_back_as_written() -> None:
    # Before the schema, an agent's GPU index went to the journal as the agent sent it.
    data = {"node": "node02", "kind": "xid", "detail": "XID 79", "gpu": "1"}
    ev = Event.from_row(9, "FaultSignal", 4.0, json.dumps({"v": 1, "data": data}))
    assert ev.data == data and ev.payload.gpu == "1"  # type: ignore[attr-defined]
    with pytest.raises(EventError, match="gpu="):
        event(EventKind.FAULT_SIGNAL, 4.0, **data)


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_kind_round_trips_through_the_journal_unchanged(kind: EventKind) -> None:
    written = event(kind, 12.5, **sample_data(kind))
    read = Event.from_row(4, kind.value, written.at, written.to_json())
    assert read.data == written.data and read.to_json() == written.to_json()
    assert read.payload == written.payload and type(read.payload) is PAYLOADS[kind]
    assert Event.of(12.5, written.payload).payload == written.payload


def test_the_typed_constructor_journals_optional_fields_only_away_from_their_default() -> None:
    exited = Event.of(2.0, WorkerExitedData(slot="rollout-0", wid="rollout-0.1", exit_code=None, signal="SIGKILL"))
    assert exited.type == EventKind.WORKER_EXITED
    assert exited.data == {"slot": "rollout-0", "wid": "rollout-0.1", "exit_code": None, "signal": "SIGKILL"}
    assert exited.as_(WorkerExitedData).error == ""
    verdict = VerdictData(node="n", slot=None, verdict="failed", fault="f", reason="r", evidence_since=0.0)
    assert Event.of(3.0, verdict).data == {"node": "n", "slot": None, "verdict": "failed", "fault": "f", "reason": "r",
                                           "evidence_since": 0.0}


def test_as_narrows_to_the_kind_and_refuses_another() -> None:
    ev = event(EventKind.TRAINER_RESTORED, 1.0, slot="trainer-0", checkpoint_step=None, replayed_steps=[1, 2],
               state_step=None)
    restored = ev.as_(TrainerRestoredData)
    assert restored.replayed_steps == [1, 2] and restored.state_step is None and ev.payload is restored
    with pytest.raises(EventError, match="TrainerRestored, not Verdict"):
        ev.as_(VerdictData)


def test_numbering_an_event_keeps_its_data_object_and_typed_view() -> None:
    ev = event(EventKind.CHECKPOINTED, 1.0, step=3, path="/c")
    view = ev.payload
    numbered = ev.numbered(9)
    assert numbered.seq == 9 and ev.seq == 0
    assert numbered.data is ev.data and numbered.payload is view


def test_a_journal_written_before_the_schema_reads_back_whole_and_replays_to_the_same_job() -> None:
    rows = rows_of(SIM_DATA / "chaos_journal.jsonl")
    events = [from_journal_row(row) for row in rows]
    assert [ev.seq for ev in events] == [row["seq"] for row in rows]
    for row, ev in zip(rows, events, strict=True):
        assert ev.data == row["data"] and type(ev.payload) is PAYLOADS[ev.type]
        assert json.loads(ev.to_json()) == {"v": 1, "data": row["data"]}
        assert event(ev.type, ev.at, **ev.data).data == ev.data, "a key it holds is no field of its kind"
    model = replay(events, load_job_file(SIM_DATA / "chaos_job.toml"))
    assert isinstance(model, JobModel)
    now = json.loads(json.dumps(snapshot(model, events[-1].at), sort_keys=True, default=str))
    assert now == json.loads(SNAPSHOT_BEFORE.read_text())
