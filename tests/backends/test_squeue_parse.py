"""Parsing Slurm 22.05 output recorded from the real lab (tests/backends/fixtures)."""

from __future__ import annotations

from pathlib import Path

from rlctl.backends.slurm_commands import parse_exit_code, parse_scontrol_record, parse_squeue_json
from rlctl.backends.slurm_states import JobOutcome, map_job_state, map_node_state

FIXTURES = Path(__file__).parent / "fixtures"


def test_running_allocations_one_task_per_node() -> None:
    tasks = parse_squeue_json((FIXTURES / "squeue-22.05-running.json").read_text())
    running = {t.job_id: t for t in tasks if t.state == "RUNNING"}
    assert {t.nodes for t in running.values()} == {"node01", "node02", "node03"}
    assert all(t.array_task_id == 0 and t.array_job_id == t.job_id for t in running.values())


def test_node_fail_is_recorded_as_hardware() -> None:
    tasks = {t.job_id: t for t in parse_squeue_json((FIXTURES / "squeue-22.05-node-fail.json").read_text())}
    failed = tasks["5"]
    assert (failed.state, failed.nodes, failed.reason) == ("NODE_FAIL", "node02", "NodeDown")
    verdict = map_job_state(failed.state, failed.exit_code)
    assert verdict.outcome is JobOutcome.HARDWARE_FAILED and verdict.hardware
    assert map_job_state(tasks["4"].state).outcome is JobOutcome.RUNNING


def test_newer_schema_shapes_are_accepted() -> None:
    text = ('{"jobs": [{"job_id": 9, "array_job_id": {"set": true, "number": 8}, "array_task_id": '
            '{"set": true, "number": 1}, "job_state": ["RUNNING"], "nodes": "n1", "name": "x", '
            '"exit_code": {"return_code": {"set": true, "number": 0}}}]}')
    (task,) = parse_squeue_json(text)
    assert task.state == "RUNNING" and task.array_task_id == 1 and task.exit_code == 0


def test_scontrol_node_line() -> None:
    rec = parse_scontrol_record((FIXTURES / "scontrol-node-22.05-idle.txt").read_text())
    assert rec["NodeName"] == "node02" and rec["NodeAddr"] == "10.213.0.12"
    assert map_node_state(rec["State"]).reachable


def test_scontrol_values_with_spaces() -> None:
    rec = parse_scontrol_record("NodeName=n1 State=IDLE+DRAIN Reason=rlctl: replaced in job x [root@2026] Comment=(null)")
    assert rec["Reason"] == "rlctl: replaced in job x [root@2026]"
    assert parse_exit_code("2:0") == (2, 0) and parse_exit_code("0:9") == (0, 9)
