"""The simulator's weight rates from measurements: a GPU-check report or a job's own pulls, through
``rlctl sim --calibrate`` and the read-only journal reader the simulator uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlctl.core.events import EventKind, event
from rlctl.journal_reader import JournalUnreadable, read_journal
from rlctl.sim.calibrate import measured_weights
from rlctl.sim.costmodel import CostModel, WeightsCost
from rlctl.sim.weight_rates import WeightRatesError, fit_pull_line, from_gpucheck, is_gpucheck_report
from tests.sim.conftest import DATA, ROOT

# An excerpt of the first GPU run's report (one H200, torch 2.11): ucx_cuda fetched 256 MiB at 0.761 GB/s.
H200_REPORT = DATA / "h200_gpucheck_weights.json"


def report_with(tmp_path: Path, parts: dict[str, Any]) -> Path:
    path = tmp_path / "gpucheck.json"
    path.write_text(json.dumps({"gpucheck": 1, "environment": {"host": "n1", "gpus": ["NVIDIA H100 80GB HBM3"],
                                                                "torch": "2.11.0", "cuda": "13.0"}, "parts": parts}))
    return path


def test_the_h200_report_gives_todays_single_node_pull_and_staging_rates() -> None:
    measured = from_gpucheck(H200_REPORT)
    figures = measured.as_dict()
    assert (figures["pull_gbps"], figures["overhead_s"], figures["stage_gbps"]) == (0.761, 0.0, 1.139)
    assert "NVIDIA H200" in figures["hardware"] and "torch 2.11.0+cu130" in figures["hardware"]
    assert figures["pulls"][0]["figure"] == "ucx_cuda.ucx_fetch_gbps" and "d2h_gbps" in figures["stage_figure"]
    weights = measured.applied(CostModel().weights)
    # The link is set so that one sender at its efficiency gives the measured rate back.
    assert weights.bandwidth_bytes_per_s * weights.sender_efficiency == pytest.approx(0.761e9)
    assert weights.stage_bytes_per_s == pytest.approx(1.139e9)
    # One holder, one joiner, as measured: the cost model gives the measured pull back, plus the two host copies.
    one = WeightsCost(bytes=2**28, bandwidth_bytes_per_s=weights.bandwidth_bytes_per_s, overhead_s=0.0,
                      stage_bytes_per_s=weights.stage_bytes_per_s)
    assert one.pull_s(2**28, 1) == pytest.approx(2**28 / 0.761e9 + 2 * 2**28 / 1.139e9)


def test_the_weights_parts_win_over_ucx_cuda_and_two_sizes_fit_the_overhead(tmp_path: Path) -> None:
    shapes = {"0.5b": {"bytes": 1e9, "end_to_end_s": 0.55, "load_gbps": 50.0},   # 0.53 s pulled, 0.02 s loaded
              "8b": {"bytes": 16e9, "end_to_end_s": 1.62, "load_gbps": 50.0}}   # 1.30 s pulled
    path = report_with(tmp_path, {
        "weights_pull_local": {"status": "failed", "error": "8b: 9.9 GB/s < 20", "shapes": shapes},
        "weights_stage": {"status": "ok", "stage_gbps": 48.0, "load_gbps": 45.0},
        "ucx_cuda": {"status": "ok", "bytes": 2**28, "ucx_fetch_gbps": 0.76, "d2h_gbps": 1.1, "h2d_pageable_gbps": 7.7}})
    figures = from_gpucheck(path).as_dict()
    assert [p["figure"].split(":")[0] for p in figures["pulls"]] == ["weights_pull_local.shapes.0.5b",
                                                                     "weights_pull_local.shapes.8b"]
    assert figures["pull_gbps"] == pytest.approx(15e9 / 0.77e9, rel=1e-3)  # slope through the two pulls
    assert figures["overhead_s"] == pytest.approx(0.53 - 1e9 * 0.77 / 15e9, abs=1e-4)
    assert figures["stage_gbps"] == 45.0 and figures["stage_figure"].startswith("weights_stage")
    assert "H100" in figures["hardware"]


def test_the_transports_pull_is_the_line_not_the_same_node_memory_file(tmp_path: Path) -> None:
    """A report whose pulls came out of the holder's memory file (``path`` shm) and, as the baseline,
    over the transport: the transport's figures are the line (it also carries pulls between nodes)."""
    shapes = {name: {"bytes": nbytes, "path": "shm", "end_to_end_s": 0.1 * scale, "load_gbps": 50.0,
                     "transport_pull": {"path": "ucx", "end_to_end_s": 0.52 * scale + 0.01, "load_gbps": 50.0}}
              for name, nbytes, scale in (("0.5b", 1e9, 1), ("8b", 16e9, 16))}
    figures = from_gpucheck(report_with(tmp_path, {"weights_pull_local": {"status": "ok", "shapes": shapes}})).as_dict()
    assert [p["figure"].split(":")[0] for p in figures["pulls"]] == ["weights_pull_local.shapes.0.5b.transport_pull",
                                                                     "weights_pull_local.shapes.8b.transport_pull"]
    assert figures["pull_gbps"] == pytest.approx(2.0, rel=1e-3)  # 1 GB in 0.5 s once the load is taken off
    assert figures["overhead_s"] == pytest.approx(0.01, abs=1e-4)


def test_pulls_device_to_device_are_the_line_where_every_shape_has_one_and_put_no_host_copy_on_the_path(
        tmp_path: Path) -> None:
    shapes = {"0.5b": {"bytes": 1e9, "end_to_end_s": 0.55, "load_gbps": 50.0,
                       "device_pull": {"end_to_end_s": 0.012, "load_gbps": 1000.0}},  # 0.011 s pulled
              "8b": {"bytes": 16e9, "end_to_end_s": 1.62, "load_gbps": 50.0,
                     "device_pull": {"end_to_end_s": 0.136, "load_gbps": 1000.0}}}  # 0.12 s pulled
    stage = {"status": "ok", "stage_gbps": 48.0, "load_gbps": 45.0}
    figures = from_gpucheck(report_with(tmp_path, {"weights_pull_local": {"status": "ok", "shapes": shapes},
                                                   "weights_stage": stage})).as_dict()
    assert [p["figure"].split(":")[0] for p in figures["pulls"]] == ["weights_pull_local.shapes.0.5b.device_pull",
                                                                     "weights_pull_local.shapes.8b.device_pull"]
    assert figures["pull_gbps"] == pytest.approx(15e9 / 0.109e9, rel=1e-3)
    assert figures["stage_gbps"] == 0.0 and "no host copy" in figures["stage_figure"]
    applied = from_gpucheck(report_with(tmp_path, {"weights_pull_local": {"status": "ok", "shapes": shapes}})).applied(
        CostModel().weights)
    assert applied.stage_bytes_per_s == 0.0 and applied.staging_s(16e9) == 0.0
    del shapes["8b"]["device_pull"]  # one shape without: the host pulls are the line, as before
    figures = from_gpucheck(report_with(tmp_path, {"weights_pull_local": {"status": "ok", "shapes": shapes},
                                                   "weights_stage": stage})).as_dict()
    assert figures["pulls"][0]["figure"].startswith("weights_pull_local.shapes.0.5b:") and figures["stage_gbps"] == 45.0


@pytest.mark.parametrize("parts, needle", [
    ({"ucx_cuda": {"status": "skipped", "reason": "ucxx not importable"}}, "were they skipped"),
    ({"weights_pull_local": {"status": "ok", "shapes": {"8b": {"bytes": 16e9}}}}, "no weight pull measured")])
def test_a_report_without_pulls_is_refused_by_name(tmp_path: Path, parts: dict[str, Any], needle: str) -> None:
    path = report_with(tmp_path, parts)
    with pytest.raises(WeightRatesError, match=needle) as refused:
        from_gpucheck(path)
    assert str(path) in str(refused.value)


def test_measured_weights_reads_a_jobs_pulls_through_the_journal_reader(tmp_path: Path) -> None:
    from rlctl.controller.store import Journal

    journal = Journal(tmp_path / "journal.db")
    journal.append([event(EventKind.WEIGHTS_HELD, 1.0, version=1, slot="rollout-0", source={}, bytes=4_000_000, seconds=2.5),
                    event(EventKind.WEIGHTS_HELD, 2.0, version=2, slot="rollout-0", source={}, bytes=1_000_000, seconds=1.0),
                    event(EventKind.WEIGHTS_HELD, 3.0, version=2, slot="rollout-1", source={})])
    expected = [(e.seq, e.type, e.data) for e in journal.read()]
    journal.close()
    assert [(e.seq, e.type, e.data) for e in read_journal(tmp_path / "journal.db")] == expected
    assert [e.seq for e in read_journal(tmp_path / "journal.db", types=("WeightsHeld",))] == [1, 2, 3]
    assert read_journal(tmp_path / "journal.db", types=("Verdict",)) == []
    figures = measured_weights(tmp_path).as_dict()
    assert (figures["pull_gbps"], figures["overhead_s"]) == (round(2e6 / 1e9, 3), 0.5)  # 1 MB in 1 s, 4 MB in 2.5 s
    assert (figures["senders"], figures["pullers"]) == (1, 1)  # a journal without a layout: one sender, one puller
    assert figures["stage_gbps"] is None and figures["source"].endswith("journal.db")
    with pytest.raises(WeightRatesError, match="no pull"):
        measured_weights(DATA / "chaos_journal.jsonl")  # written before pulls carried bytes and seconds
    (tmp_path / "junk.db").write_text("not sqlite")
    with pytest.raises(JournalUnreadable, match="not an rlctl journal"):
        read_journal(tmp_path / "junk.db")
    with pytest.raises(WeightRatesError, match="not a GPU-check report"):
        measured_weights(tmp_path / "missing.json")


def test_fit_pull_line_needs_a_pull() -> None:
    assert fit_pull_line([(8e6, 2.0), (8e6, 4.0), (8e6, 3.0)]) == (pytest.approx(8e6 / 3.0), 0.0)
    with pytest.raises(ValueError, match="no pull"):
        fit_pull_line([(0.0, 1.0)])


def sim_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlctl.cli", "sim", str(ROOT / "examples" / "quickstart.toml"), *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_rlctl_sim_calibrate_with_a_gpucheck_report_simulates_with_the_measured_rates(tmp_path: Path) -> None:
    common = ("--gpus", "256", "--steps", "20", "--policy", "role", "--rate", "0", "--json")
    assumed = sim_cli(*common)
    measured = sim_cli(*common, "--calibrate", str(H200_REPORT))
    assert assumed.returncode == 0 and measured.returncode == 0, measured.stderr
    before, after = json.loads(assumed.stdout), json.loads(measured.stdout)
    assert after["calibration"]["pull_gbps"] == 0.761 and "calibration" not in before
    # 184 engines pull 16 GB from 64 ranks at 0.76 GB/s through host memory: a step is a minute longer.
    assert after["mean_step_s"] - before["mean_step_s"] > 60
    assert is_gpucheck_report(H200_REPORT) and not is_gpucheck_report(DATA / "chaos_job.toml")
    bad = tmp_path / "bad.json"
    bad.write_text('{"parts": {}}')
    refused = sim_cli("--calibrate", str(bad))
    assert refused.returncode == 2 and "not a GPU-check report" in refused.stderr
