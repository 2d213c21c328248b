"""The view says what it means: a round that finished more groups than its target shows them as
extra, in the progress line and the round panel alike, and a released node shows no heartbeat age
or phase (what it last reported is no longer true)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlctl.cli.render import DETAIL_NODES, render_status, status_line


def _node(name: str, state: str, phase: str, age: float) -> dict[str, Any]:
    return {"name": name, "role": "rollout", "state": state, "worker_state": "exited" if state == "released" else "running",
            "phase": phase, "heartbeat_age_s": age, "gpu_util": None, "gpu_temp_c": None, "gpu_mem_used": None,
            "gpu_mem_total": None, "last_signal": ""}


def _status(groups_done: int, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "job": {"id": "quickstart-1", "state": "succeeded", "step": 32, "total_steps": 32, "elapsed_s": 1900.0,
                "ettr": 0.877, "policy": "role", "ledger_s": {"productive": 1660.0}, "checkpoint_step": 32,
                "weights_version": 32},
        "roles": [{"role": "rollout", "slots": 2, "states": {"stopped": 2}, "phases": [], "weights_version": 32}],
        "round": {"step": 31, "kind": "short", "max_new_tokens": 24, "groups_done": groups_done, "groups_target": 16,
                  "samples_generated": 184, "samples_total": 192, "longest_response": 24, "deferred": 2,
                  "long_queue": 3, "pool": 8, "epoch": 1},
        "nodes": nodes,
        "events": [],
        "controller": {"live": False},
    }


def _text(status: dict[str, Any], width: int = 120) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console.print(render_status(status, width))
    return console.export_text()


def test_over_provisioned_groups_read_the_same_in_the_progress_line_and_the_panel() -> None:
    status = _status(23, [_node("node01", "active", "generating", 0.3)])
    assert "short round groups 16/16 (+7 extra) longest 24" in status_line(status)
    assert "23/16" not in status_line(status)
    view = _text(status)
    assert "groups 16/16 (+7 extra)" in view and "23/16" not in view
    partial = _status(9, status["nodes"])
    assert "short round groups 9/16 longest" in status_line(partial) and "extra" not in _text(partial)


def _node_rows(text: str) -> list[dict[str, str]]:
    """The nodes table's rows as {header: cell}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("nodes ("))
    header = [cell.strip() for cell in lines[start + 2].split("┃")[1:-1]]
    rows = []
    for line in lines[start + 4:]:
        if not line.startswith("│"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.split("│")[1:-1]))))
    return rows


def test_a_released_node_shows_no_heartbeat_age_or_phase() -> None:
    nodes = [_node("node01", "released", "stopping", 1829.0), _node("node02", "active", "generating", 0.4)]
    for width, heartbeat in ((120, "heartbeat"), (80, "hb")):
        released, live = _node_rows(_text(_status(16, nodes), width))
        assert released["node"] == "node01" and released["state"] == "released"
        assert released[heartbeat] == "-" and released["phase"] == "-"
        assert live[heartbeat] == "0.4s" and live["phase"] == "generating"

    many = [_node(f"node{i:02d}", "released", "stopping", 1800.0 + i) for i in range(DETAIL_NODES + 1)]
    [condensed] = _node_rows(_text(_status(16, many)))
    assert condensed["node"] == f"{DETAIL_NODES + 1} nodes" and condensed["state"] == "released"
    assert condensed["heartbeat"] == "-"
