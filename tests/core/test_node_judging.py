"""The core's node judge, which the live controller's detection and the simulator both call:
silence → suspect → the probe's answer → verdict, the all-quiet hold, the resume grace, the
probe answer's time to live and the bound on an agent that never registers."""

from __future__ import annotations

from rlctl.core import detector as det
from rlctl.core.events import event
from rlctl.core.node_judging import (
    AGENT_REGISTER_TIMEOUT_S,
    PROBE_TTL_S,
    NodeJudge,
    NodeSighting,
    ProbeAnswer,
    SightingTable,
)
from tests.core.test_policy import running_job

NOW = 1000.0


def judge() -> NodeJudge:
    config = det.DetectorConfig(heartbeat_interval_s=1.0, phi_threshold=8.0, min_silence_s=3.0, confirm_with_probe=True,
                                phase_timeout_s={}, slow_ratio=3.0, slow_window_s=30.0)
    detector = det.Detector(config)
    for node in ("node01", "node02", "node03", "node04", "node05"):
        for beat in range(20):
            detector.heartbeat(node, NOW - 60.0 + beat)
    return NodeJudge(detector, config.min_silence_s)


def sightings(silent: dict[str, float], probe: ProbeAnswer | None = None,
              disconnected: frozenset[str] = frozenset()) -> SightingTable:
    """Every node of the test job beating now, except ``silent`` (node → its last beat)."""
    names = ("node01", "node02", "node03", "node04", "node05")
    return SightingTable({n: NodeSighting(n, silent.get(n, NOW - 0.5), n not in disconnected,
                                          probe if n in silent else None) for n in names})


def test_a_silent_node_is_suspected_then_convicted_by_what_the_probe_says() -> None:
    model, nodes = running_job(), judge()
    first = nodes.judge(model, sightings({"node02": NOW - 30.0}), NOW)
    assert [v.node for v in first.suspects] == ["node02"] and not first.verdicts and not first.all_quiet
    assert first.suspects[0].action == "probe"
    unreachable = nodes.judge(model, sightings({"node02": NOW - 30.0}, ProbeAnswer(False, "timed out", NOW)), NOW)
    assert [(v.node, v.fault, v.action) for v in unreachable.verdicts] == [("node02", "node-loss", "replace-node")]
    reachable = nodes.judge(model, sightings({"node02": NOW - 30.0}, ProbeAnswer(True, "sshd answers", NOW)), NOW)
    assert [(v.fault, v.action) for v in reachable.verdicts] == [("agent-lost", "restart-agent")]
    assert "sshd answers" in reachable.verdicts[0].reason


def test_an_old_probe_answer_is_no_evidence() -> None:
    stale = ProbeAnswer(False, "timed out", NOW - PROBE_TTL_S - 0.1)
    judgement = judge().judge(running_job(), sightings({"node02": NOW - 30.0}, stale), NOW)
    assert [v.verdict for v in judgement.suspects] == ["suspect"] and not judgement.verdicts


def test_every_node_quiet_at_once_holds_the_verdicts_then_judges_them_one_by_one() -> None:
    model, nodes = running_job(), judge()
    everyone = {n: NOW - 30.0 for n in ("node01", "node02", "node03", "node04", "node05")}
    held = nodes.judge(model, sightings(everyone), NOW)
    assert held.all_quiet and not held.suspects and not held.verdicts
    later = nodes.judge(model, sightings(everyone), NOW + 6.0)  # past correlated_silence_hold_s (5 s)
    assert not later.all_quiet and len(later.suspects) == 5
    assert later.about("node03").suspects[0].node == "node03" and len(later.about("node03").suspects) == 1


def test_a_resumed_controller_does_not_blame_a_disconnected_node_in_its_grace() -> None:
    model, nodes = running_job(), judge()
    silent = sightings({"node02": NOW - 30.0}, disconnected=frozenset({"node02"}))
    assert not nodes.judge(model, silent, NOW, in_resume_grace=True).suspects
    assert nodes.judge(model, silent, NOW, in_resume_grace=False).suspects


def test_a_node_whose_agent_never_registers_is_replaced_after_the_bound() -> None:
    model, nodes = running_job(), judge()
    model.apply(event("NodeAllocated", NOW, node="node09", host="h", role="rollout", slot="", standby=False,
                      role_of_slot="rollout"))
    model.apply(event("NodeStateChanged", NOW, node="node09", state="starting", reason="agent started"))
    assert nodes.startup(model, NOW) == []
    assert nodes.startup(model, NOW + AGENT_REGISTER_TIMEOUT_S - 1) == []
    [verdict] = nodes.startup(model, NOW + AGENT_REGISTER_TIMEOUT_S + 1)
    assert (verdict.node, verdict.fault, verdict.action, verdict.evidence_since) == ("node09", "agent-start",
                                                                                      "replace-node", NOW)


class CountingSightings:
    """The shell's side, counting which nodes the judge asked for a whole sighting."""

    def __init__(self, table: SightingTable) -> None:
        self.table, self.asked = table, []

    def last_heartbeat_at(self, node: str) -> float | None:
        return self.table.last_heartbeat_at(node)

    def sighting(self, node: str) -> NodeSighting:
        self.asked.append(node)
        return self.table.sighting(node)


def test_only_nodes_quiet_past_the_pause_are_asked_for_a_whole_sighting() -> None:
    shell = CountingSightings(sightings({"node02": NOW - 30.0}))
    judgement = judge().judge(running_job(), shell, NOW)
    assert shell.asked == ["node02"] and [v.node for v in judgement.suspects] == ["node02"]
