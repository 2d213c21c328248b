"""The live view in a plain 80x24 terminal: columns drop instead of wrapping, and reward reads as
a trend per round kind."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlctl.cli.render import fitting_columns, render_status, status_line
from rlctl.core.snapshot import reward_trend


def _status(nodes: int = 5) -> dict[str, Any]:
    metrics = {step: {"mean_reward": 0.40 + 0.01 * step if step % 4 else 0.2, "round": "long" if step % 4 == 0 else "short"}
               for step in range(12)}
    return {
        "job": {"id": "quickstart-20261124-211913-aff5", "state": "running", "step": 12, "total_steps": 40,
                "elapsed_s": 75.2, "ettr": 0.93, "policy": "role", "ledger_s": {"productive": 70.0, "init": 5.2},
                "checkpoint_step": 10, "weights_version": 12},
        "roles": [{"role": r, "slots": 2, "states": {"running": 2}, "phases": ["generating"], "weights_version": 12}
                  for r in ("trainer", "rollout", "reward")],
        "round": {"step": 12, "kind": "short", "max_new_tokens": 24, "groups_done": 9, "groups_target": 16,
                  "samples_generated": 80, "samples_total": 192, "longest_response": 24, "deferred": 3, "long_queue": 5,
                  "pool": 20, "epoch": 2},
        "nodes": [{"name": f"node{i:02d}", "role": "rollout", "state": "active", "worker_state": "running",
                   "phase": "waiting-for-batch", "heartbeat_age_s": 0.4, "gpu_util": 55.0, "gpu_temp_c": 61.0,
                   "gpu_mem_used": 2**31, "gpu_mem_total": 2**34, "last_signal": "xid-13 (app error)"}
                  for i in range(nodes)],
        "reward_trend": reward_trend(metrics),
        "events": [{"seq": 1, "type": "Verdict", "summary": "node03 worker-crash"}],
        "controller": {"live": True},
    }


def _lines(width: int, status: dict[str, Any]) -> list[str]:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console.print(render_status(status, width))
    return console.export_text().splitlines()


def test_the_view_fits_80_columns_without_wrapping_cells() -> None:
    lines = _lines(80, _status())
    assert all(len(line) <= 80 for line in lines)
    node_rows = [line for line in lines if line.startswith("│node0")]
    assert len(node_rows) == 5  # one line per node: no cell wrapped onto a second line
    assert not [line for line in lines if line.strip("│ ").startswith(("/", "beat"))]
    wide = _lines(160, _status())
    assert any("GPU mem" in line for line in wide) and not any("GPU mem" in line for line in lines)


def test_columns_are_kept_in_priority_order_while_they_fit() -> None:
    columns = [("a", "a", 10), ("b", "b", 10), ("c", "c", 30), ("d", "d", 5)]
    assert [c[0] for c in fitting_columns(columns, 40)] == ["a", "b", "d"]
    assert [c[0] for c in fitting_columns(columns, 10)] == ["a", "b"]  # never fewer than two


def test_reward_is_a_moving_average_per_round_kind() -> None:
    trend = reward_trend({0: {"mean_reward": 0.1, "round": "short"}, 1: {"mean_reward": 0.3, "round": "short"},
                          2: {"mean_reward": 0.05, "round": "long"}, 3: {"mean_reward": 0.5}})
    assert trend["short"] == {"mean": 0.2, "steps": 2} and trend["long"]["mean"] == 0.05 and trend["sync"]["steps"] == 1
    long_run = reward_trend({s: {"mean_reward": float(s), "round": "short"} for s in range(20)})
    assert long_run["short"] == {"mean": 17.0, "steps": 5}
    line = status_line(_status())
    assert "reward short 0.486 (avg 5)  long 0.200 (avg 3)" in line


def test_held_out_reward_shows_in_the_header_and_a_running_evaluation_in_the_round_panel() -> None:
    status = _status()
    status["held_out"] = [{"version": 0, "prompts": 32, "reward_mean": 0.48, "reward_std_err": 0.03, "accuracy": 0.4},
                          {"version": 10, "prompts": 32, "reward_mean": 0.612, "reward_std_err": 0.03, "accuracy": 0.5}]
    status["round"]["held_out"] = {"version": 12, "samples_total": 32, "samples_scored": 5}
    lines = _lines(80, status)
    assert all(len(line) <= 80 for line in lines)
    assert any("held-out reward 0.612 ± 0.030 at v10  (v0: 0.480)" in line for line in lines)
    progress = [line for line in lines if "held-out evaluation of v12: 5/32 scored" in line]
    assert len(progress) == 1 and "━" not in progress[0]  # its own line, not run into the progress bar


def test_the_round_panel_shows_the_groups_dynamic_sampling_dropped() -> None:
    status = _status()
    status["round"].update(groups_filtered=5, gen_batches=2)
    text = "\n".join(_lines(160, status))
    assert "groups 9/16  filtered 5 (gen batch 2)" in text
    assert "filtered" not in "\n".join(_lines(160, _status()))  # a round that dropped nothing says nothing
