"""The model's node -> slots index answers exactly what a scan of every slot would, after every
event of journals that move slots around (standby take-overs, node replacements, vacated slots),
and a heartbeat summary that names only the quiet nodes restores every node's last heartbeat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlctl.core.events import Event, event
from rlctl.core.model import JobModel
from rlctl.sim.calibrate import read_events
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import SimFault, TraceFailures
from rlctl.spec_loader import load_job_file
from tests.sim.conftest import DATA, ROOT


def _scan(model: JobModel, node: str) -> list[str]:
    return [s.slot for s in model.slots.values() if s.node == node]


def _check_replay(events: list[Event]) -> int:
    model = JobModel(job_id="index")
    moves = 0
    placed: dict[str, str | None] = {}
    for ev in events:
        model.apply(ev)
        for node in model.nodes:
            assert [s.slot for s in model.slots_on_node(node)] == _scan(model, node), (ev.type, ev.data)
            first = next((s for s in model.slots.values() if s.node == node and not s.standby), None)
            assert model.slot_on_node(node) is first
        now = {name: slot.node for name, slot in model.slots.items()}
        moves += sum(1 for name, node in now.items() if name in placed and placed[name] != node)
        placed = now
    return moves


def test_index_matches_a_scan_through_a_real_chaos_journal() -> None:
    _check_replay(read_events(DATA / "chaos_journal.jsonl"))


@pytest.mark.parametrize("kind,role", [("node-down", "rollout"), ("node-down", "trainer"), ("slow", "reward"),
                                       ("partition", "rollout")])
def test_index_matches_a_scan_when_faults_move_slots(quickstart: Any, kind: str, role: str) -> None:
    params = {"factor": 8.0, "duration": 600.0} if kind == "slow" else {}
    faults = [SimFault(at=500.0, kind=kind, role=role, params=params),
              SimFault(at=1500.0, kind="node-down", role="reward")]
    sim = Simulation(quickstart, CostModel(), TraceFailures(faults), SimConfig(steps=15, seed=2, record_events=True))
    sim.run()
    assert _check_replay(sim.events) > 0, "no slot moved: the journal does not exercise the index"


def test_index_matches_a_scan_when_slots_move_to_cold_spares(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "quickstart.toml").read_text().replace("warm = true", "warm = false")
    (tmp_path / "cold.toml").write_text(text)
    spec = load_job_file(tmp_path / "cold.toml")
    faults = [SimFault(at=500.0, kind="node-down", role="rollout"), SimFault(at=1500.0, kind="node-down", role="reward"),
              SimFault(at=2500.0, kind="node-down", role="rollout")]
    sim = Simulation(spec, CostModel(), TraceFailures(faults), SimConfig(steps=20, seed=3, record_events=True))
    sim.run()
    assert any(e.type == "ActionTaken" and e.data["action"] == "move-slot" for e in sim.events)
    assert _check_replay(sim.events) > 0


def test_heartbeat_summary_of_quiet_nodes_restores_every_last_heartbeat() -> None:
    model = JobModel(job_id="beats")
    model.apply(event("JobSubmitted", 100.0, job_id="beats", spec_file="job.toml", backend="local", policy="role", steps=3))
    for name in ("node01", "node02", "node03"):
        model.apply(event("NodeAllocated", 100.0, node=name, host="127.0.0.1", role="rollout", slot="", standby=False))
    model.apply(event("HeartbeatSummary", 110.0, beats=20, nodes=2, window_s=5.0, fresh_since=108.0,
                      silent={"node03": 104.5}))
    assert [model.nodes[n].last_heartbeat_at for n in ("node01", "node02", "node03")] == [108.0, 108.0, 104.5]
    model.nodes["node01"].last_heartbeat_at = 114.9  # heard live since: a later summary never moves it back
    model.apply(event("HeartbeatSummary", 115.0, beats=20, nodes=1, window_s=5.0, fresh_since=113.0,
                      silent={"node02": 108.0, "node03": None}))
    assert [model.nodes[n].last_heartbeat_at for n in ("node01", "node02", "node03")] == [114.9, 108.0, 104.5]
