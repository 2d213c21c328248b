"""The status snapshot: one JSON-able view of a job model at a given time.

What `rlctl status --json` prints and what the live view renders, whether it comes from a
running controller or from replaying the journal of a stopped one. Pure.
"""

from __future__ import annotations

from typing import Any

from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.states import NodeState

RECENT_IN_SNAPSHOT = 12
SUMMARY_FIELDS = ("node", "slot", "state", "phase", "verdict", "action", "reason", "kind", "step", "version")
REWARD_WINDOW = 5  # steps in each round kind's moving average


def snapshot(model: JobModel, now: float, controller: dict[str, Any] | None = None) -> dict[str, Any]:
    ledger = model.live_ledger(now)
    end = now if not model.life.state.terminal else model.life.since
    elapsed = max(0.0, end - model.ledger.started_at)
    last_metrics = model.step_metrics.get(model.step - 1, {})
    return {
        "job": {
            "id": model.job_id,
            "state": model.life.state.value,
            "state_reason": model.life.history[-1].reason if model.life.history else "",
            "policy": model.policy,
            "step": model.step,
            "total_steps": model.total_steps,
            "elapsed_s": round(elapsed, 3),
            "ettr": round(ledger.ettr(), 4),
            "ledger_s": {k: round(v, 3) for k, v in ledger.seconds.items()},
            "mean_reward": last_metrics.get("mean_reward"),
            "checkpoint_step": model.checkpoint_step,
            "weights_version": model.published_version,
        },
        "roles": _roles(model),
        "nodes": _nodes(model, now),
        "round": model.scheduler.progress() if model.scheduler is not None else {},
        "rewards": {str(step): m.get("mean_reward") for step, m in sorted(model.step_metrics.items())},
        "reward_trend": reward_trend(model.step_metrics),
        "held_out": list(model.scheduler.held_out_results) if model.scheduler is not None else [],
        "reward_function": model.reward_calls.as_dict(),
        "faults": [_fault(f) for f in model.faults.values()],
        "events": [_event_line(e) for e in list(model.recent)[-RECENT_IN_SNAPSHOT:]],
        "controller": controller or {"live": False},
        "journal_seq": model.last_seq,
    }


def reward_trend(step_metrics: dict[int, dict[str, Any]], window: int = REWARD_WINDOW) -> dict[str, dict[str, Any]]:
    """Per round kind (``short``, ``long``, ``sync``), the mean training reward of its last
    ``window`` steps: a long round's harder prompts do not read as a fall of the short rounds'."""
    by_kind: dict[str, list[float]] = {}
    for _, metrics in sorted(step_metrics.items()):
        reward = metrics.get("mean_reward")
        if isinstance(reward, (int, float)):
            by_kind.setdefault(str(metrics.get("round") or "sync"), []).append(float(reward))
    return {kind: {"mean": round(sum(values[-window:]) / len(values[-window:]), 4), "steps": len(values[-window:])}
            for kind, values in by_kind.items()}


def _roles(model: JobModel) -> list[dict[str, Any]]:
    out = []
    for role in ("trainer", "rollout", "reward", "env"):
        slots = model.slots_of(role)
        if not slots and role == "env":
            continue
        states: dict[str, int] = {}
        for slot in slots:
            state = slot.life.state.value if slot.life else "pending"
            states[state] = states.get(state, 0) + 1
        versions = [s.weights_version for s in slots if s.weights_version >= 0]
        out.append(
            {
                "role": role,
                "slots": len(slots),
                "states": states,
                "phases": sorted({s.phase for s in slots}),
                "weights_version": model.published_version if role == "trainer" else (min(versions) if versions else None),
            }
        )
    standbys = model.standby_slots()
    if standbys or any(n.role == "spare" for n in model.nodes.values()):
        out.append(
            {
                "role": "spare",
                "slots": len(standbys),
                "states": {"standby": len(standbys)},
                "phases": sorted({s.phase for s in standbys}),
                "weights_version": None,
            }
        )
    return out


def _nodes(model: JobModel, now: float) -> list[dict[str, Any]]:
    out = []
    by_node: dict[str, Any] = {}
    for candidate in model.slots.values():
        if candidate.node is not None and (candidate.node not in by_node or by_node[candidate.node].standby):
            by_node[candidate.node] = candidate
    for node in model.nodes.values():
        worker = by_node.get(node.name)
        slot = worker if worker is not None and not worker.standby else None
        gpu = node.gpu_summary
        released = node.life.state == NodeState.RELEASED  # given back: no heartbeat or phase of it means anything
        out.append(
            {
                "name": node.name,
                "host": node.host,
                "role": slot.role if slot else node.role,
                "slot": worker.slot if worker else None,
                "state": node.life.state.value,
                "excluded": node.excluded,
                "connected": node.connected,
                "heartbeat_age_s": round(now - node.last_heartbeat_at, 3) if node.last_heartbeat_at and not released else None,
                "worker_state": worker.life.state.value if worker and worker.life else None,
                "phase": worker.phase if worker and not released else None,
                "progress": worker.progress if worker else None,
                "gpu_util": gpu.util if gpu else None,
                "gpu_temp_c": gpu.temp_c if gpu else None,
                "gpu_mem_used": gpu.mem_used if gpu else None,
                "gpu_mem_total": gpu.mem_total if gpu else None,
                "last_signal": node.last_signal,
            }
        )
    return out


def _fault(fault: Any) -> dict[str, Any]:
    return {
        "fault_id": fault.fault_id,
        "kind": fault.kind,
        "verdict": fault.verdict,
        "node": fault.node,
        "slot": fault.slot,
        "injected": fault.injected,
        "occurred_at": fault.occurred_at,
        "detected_at": fault.detected_at,
        "recovered_at": fault.recovered_at,
        "detection_s": round(fault.detected_at - fault.occurred_at, 3) if fault.detected_at else None,
        "recovery_s": round(fault.recovered_at - fault.detected_at, 3) if fault.recovered_at and fault.detected_at else None,
        "action": fault.action,
        "reason": fault.reason,
        "trajectories_lost": fault.trajectories_lost,
        "refused": fault.refused,
    }


def _event_line(ev: Event) -> dict[str, Any]:
    """One recent event: the fields of ``SUMMARY_FIELDS`` its kind has, where set."""
    values = ((name, getattr(ev.payload, name, None)) for name in SUMMARY_FIELDS)
    summary = " ".join(f"{name}={value}" for name, value in values if value not in (None, ""))
    return {"seq": ev.seq, "at": ev.at, "type": ev.type, "summary": summary[:160]}
