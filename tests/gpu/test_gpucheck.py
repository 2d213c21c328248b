"""The GPU check: its JSON report's shape (anywhere) and, on a GPU node, its values.

``test_run_sh_report`` is marked ``gpu`` and runs ``tests/gpu/run.sh`` for real: without a GPU
every part must be skipped with a reason and the exit status must be 0; with one, the parts
that prove rlctl's GPU paths must pass. The other tests check the parts' pure logic here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rlctl.gpucheck.nvml_part import facts_problems, sample_problems
from rlctl.gpucheck.outcome import CheckFailed, Skip
from rlctl.gpucheck.report import PART_NAMES, run_part

ROOT = Path(__file__).resolve().parents[2]
STATUSES = {"ok", "skipped", "failed"}


def run_gpucheck(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), *args], capture_output=True, text=True,
                          timeout=1200, cwd=ROOT, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be one JSON line, got {proc.stdout[-2000:]!r}; stderr {proc.stderr[-2000:]}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def check_shape(report: dict[str, Any]) -> None:
    assert report["gpucheck"] == 1
    assert set(report["parts"]) == set(PART_NAMES)
    for name, part in report["parts"].items():
        assert part["status"] in STATUSES, name
        assert isinstance(part["seconds"], float)
        if part["status"] == "skipped":
            assert part["reason"], name
        if part["status"] == "failed":
            assert part["error"], name
    assert sum(report["summary"].values()) == len(PART_NAMES)
    assert report["ok"] == (report["summary"]["failed"] == 0)


def check_gpu_values(report: dict[str, Any]) -> None:
    parts = report["parts"]
    failed = {k: v.get("error") for k, v in parts.items() if v["status"] == "failed"}
    assert not failed, failed
    for name in ("nvml", "nvml_sample_cost", "torch_rollout", "torch_decode", "torch_train_step", "nccl_watchdog"):
        assert parts[name]["status"] == "ok", (name, parts[name])
    assert parts["nvml"]["gpus"] and parts["nvml_sample_cost"]["ms_per_sample_median"] > 0
    assert parts["torch_rollout"]["cuda_large"]["tokens_per_s"] > 0
    assert parts["torch_rollout"]["cuda_default"]["decode_path"] == "graph"
    assert parts["torch_decode"]["missed_goals"] == []
    assert parts["torch_train_step"]["large"]["step_s_median"] > 0
    assert parts["nccl_watchdog"]["watchdog_classified"] or parts["nccl_watchdog"]["signals"]
    if parts["ucx_cuda"]["status"] == "ok":
        assert parts["ucx_cuda"]["bit_exact"] and parts["ucx_cuda"]["ucx_fetch_gbps"] > 0


@pytest.mark.gpu
def test_run_sh_report(tmp_path: Path) -> None:
    code, report, stderr = run_gpucheck("--report", str(tmp_path / "out" / "gpucheck.json"))
    check_shape(report)
    assert json.loads((tmp_path / "out" / "gpucheck.json").read_text()) == report
    assert not list((tmp_path / "out").glob("*.partial"))
    if report["environment"].get("cuda_available"):
        check_gpu_values(report)
        assert code == 0, stderr[-3000:]
    else:
        assert code == 0
        assert all(p["status"] == "skipped" for p in report["parts"].values()), report["parts"]


def test_the_report_file_is_rewritten_after_every_part() -> None:
    from rlctl.gpucheck.report import run_all

    # A check cut short by a time limit must leave what it measured: the report so far after each part.
    snapshots: list[dict[str, Any]] = []
    final = run_all(["nvml", "nvml_sample_cost"], after_part=snapshots.append)
    assert [s["pending"] for s in snapshots[:1]] == [["nvml_sample_cost"]] and "pending" not in snapshots[1]
    assert not snapshots[0]["ok"] and snapshots[1] == final and list(final["parts"]) == ["nvml", "nvml_sample_cost"]
    environment = final["environment"]
    assert environment["checksum"].endswith("-t64m") and environment["transformers"]
    assert set(environment) >= {"driver", "ucxx", "libucx", "xxhash", "torch", "cuda_available"}



def test_run_part_statuses() -> None:
    def ok() -> dict[str, Any]:
        return {"x": 1}

    def skip() -> dict[str, Any]:
        raise Skip("no widget")

    def broken() -> dict[str, Any]:
        raise CheckFailed("value out of range")

    assert run_part("a", ok)["status"] == "ok" and run_part("a", ok)["x"] == 1
    assert run_part("b", skip) == {"status": "skipped", "reason": "no widget", "seconds": pytest.approx(0, abs=1)}
    failed = run_part("c", broken)
    assert failed["status"] == "failed" and "value out of range" in failed["error"]


def test_nvml_sanity_rules() -> None:
    good = {"index": 0, "util": 37, "mem_used": 10, "mem_total": 80, "temp_c": 41, "power_w": 312.5,
            "ecc_sbe": 0, "ecc_dbe": 0, "lost": False}
    assert sample_problems(good) == []
    assert sample_problems({**good, "power_w": None}) == []  # unsupported query
    assert sample_problems({**good, "util": 140})
    assert sample_problems({**good, "mem_used": 90})
    assert sample_problems({**good, "lost": True})
    assert facts_problems({"gpus": [{"index": 0, "name": "NVIDIA H100", "uuid": "GPU-1", "memory_total": 8}]}) == []
    assert facts_problems({"gpus": []}) == ["no GPUs enumerated"]


def test_nccl_part_classifies_a_real_watchdog_log(tmp_path: Path) -> None:
    from rlctl.gpucheck.nccl_part import classify_logs as _classify

    log = tmp_path / "rank0.log"
    log.write_text(
        "gpucheck-nccl warmup ok rank=0 sum=1\n"
        "[rank0]:[E1121 18:37:01.833 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=5000) ran for "
        "5012 milliseconds before timing out.\n"
        "[rank0]:[E1121 18:37:01.900 ProcessGroupNCCL.cpp:1600] [PG 0 (default_pg) Rank 0] ProcessGroupNCCL "
        "preparing to dump debug info. Include stack trace: 1, only active collectives: 0\n")
    signals = _classify([log])
    timeout = next(s for s in signals if s["kind"] == "nccl-timeout")
    assert timeout["trigger"] == "watchdog-timeout" and timeout["op_type"] == "ALLREDUCE"
    assert timeout["timeout_ms"] == 5000 and timeout["seq"] == 2
    assert any(s["kind"] == "nccl-flight-recorder" for s in signals)


@pytest.mark.timeout(120)
def test_the_nccl_part_kills_a_rank_through_the_agents_watch_loop_on_cpu(tmp_path: Path) -> None:
    import sys

    from rlctl.gpucheck.nccl_part import missed_goals, nccl_settings, run_figures, watchdog_kill_run

    # The nccl_watchdog part's harness with a CPU stand-in rank: stall, the watchdog line 1 s later, then a hang.
    standin = str(Path(__file__).with_name("watchdog_standin.py"))
    settings = nccl_settings(tmp_path, "2.11.0+cu130")
    run = watchdog_kill_run(1, settings, tmp_path, lambda rank, world, port: [
        sys.executable, standin, "--rank", str(rank), "--timeout-s", "1.0"])
    figures = run_figures(run, settings)
    assert missed_goals(figures) == [], figures
    assert figures["killed_by_agent"] and figures["exit"]["reason"] == "nccl-timeout", figures
    assert figures["exit"]["signal"] == "SIGKILL" and figures["exit_codes"] == [-9]
    assert 1.0 <= figures["watchdog_line_read_s"] <= figures["worker_gone_s"] <= 4.0, figures
    assert figures["kill_after_line_s"] <= 2.0, figures
    assert figures["env"]["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in figures["env"]


def test_an_nccl_figure_past_its_goal_fails_the_part() -> None:
    from rlctl.gpucheck.nccl_part import missed_goals

    passing = {"warmup_ok": True, "watchdog_classified": True, "stall_seen": True, "worker_gone_s": 6.3,
               "exit": {"reason": "nccl-timeout", "signal": "SIGKILL"}}
    assert missed_goals(passing) == []
    assert run_part("nccl_watchdog", lambda: _raise_missed(passing))["status"] == "ok"
    cases = [({"worker_gone_s": 48.8}, "gone 48.8 s after the stall (goal <= 10 s)"),
             ({"worker_gone_s": None}, "was not gone"),
             ({"stall_seen": False, "worker_gone_s": None}, "never reached the stall"),
             ({"exit": {"reason": "killed-by-signal", "signal": "SIGABRT"}}, "'killed-by-signal'"),
             ({"watchdog_classified": False}, "no watchdog timeout")]
    for change, words in cases:
        figures = {**passing, **change}
        result = run_part("nccl_watchdog", lambda figures=figures: _raise_missed(figures))
        assert result["status"] == "failed" and words in result["error"], result["error"]
        assert result["worker_gone_s"] == figures["worker_gone_s"]  # the figures stay in the report


def _raise_missed(figures: dict[str, Any]) -> dict[str, Any]:
    from rlctl.gpucheck.nccl_part import missed_goals

    if problems := missed_goals(figures):
        raise CheckFailed("; ".join(problems), figures)
    return figures


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_local_job_part_runs_a_whole_job_through_two_crashes_on_cpu(tmp_path: Path) -> None:
    from rlctl.gpucheck.local_job_part import CPU_TWIN, missed_goals, run_local_job
    from tests.hf_models import gsm8k_data, tiny_model

    # The GPU check's local_job part with the tiny Qwen3 on CPU (about a minute on two cores).
    figures = run_local_job(CPU_TWIN, tmp_path, model=tiny_model(), train_file=gsm8k_data() / "train.parquet")
    assert missed_goals(figures) == [], figures
    assert (figures["state"], figures["steps_done"], figures["trajectories_lost"]) == ("succeeded", CPU_TWIN.steps, 0)
    assert figures["faults"]["trainer_crash"]["verdict"] == "worker-crash" and figures["faults"]["trainer_crash"]["recovered_at"]
    assert figures["faults"]["rollout_crash"]["verdict"] == "worker-crash"
    assert 0 < figures["ettr"] < 1 and len(figures["weight_sync_s"]) >= CPU_TWIN.steps - 2
    assert all(seconds > 0 for seconds in figures["weight_sync_s"].values()) and figures["lanes_seen"]
    assert figures["worker_errors"] == [], figures["worker_errors"]  # no worker failed by itself
    if importlib.util.find_spec("ucxx") is not None:  # [weights] device_memory = "on": the GPU path's CPU twin
        assert figures["memory_seen"] == ["device"], figures


def test_the_local_job_parts_figures_and_goals() -> None:
    from rlctl.gpucheck.local_job_part import missed_goals, weight_sync_by_step, worker_errors

    records = [{"type": "WeightsHeld", "data": {"version": 1, "seconds": 0.4, "lanes": ["tcp/lo"]}},
               {"type": "WeightsHeld", "data": {"version": 1, "seconds": 0.7, "lane": "sm"}},
               {"type": "WeightsHeld", "data": {"version": 2, "seconds": 0.5}},
               {"type": "WeightsHeld", "data": {"version": 0, "seconds": 9.0}},  # the initial weights, not a step's
               {"type": "WeightsHeld", "data": {"version": 3, "source": {}}}]  # held without a pull
    sync = weight_sync_by_step(records)
    assert sync["weight_sync_s"] == {"1": 0.7, "2": 0.5}
    assert sync["lanes"] == {"1": ["sm", "tcp/lo"], "2": ["unknown"]} and sync["lanes_seen"] == ["sm", "tcp/lo", "unknown"]
    assert sync["memory_seen"] == ["unknown"]
    assert weight_sync_by_step([{"data": {"version": 1, "seconds": 0.1, "memory": "device"}}])["memory_seen"] == ["device"]
    exits = [{"data": {"slot": "rollout-0", "wid": "w1", "exit_code": None, "signal": "SIGKILL"}},  # injected
             {"data": {"slot": "trainer-0", "wid": "w0", "exit_code": None, "signal": "SIGTERM",  # the stop
                       "error": "Error while closing endpoint: Connection reset by remote peer"}},
             {"data": {"slot": "rollout-1", "wid": "w3", "exit_code": 0, "signal": None}},
             {"data": {"slot": "trainer-0", "wid": "w2", "exit_code": 1, "signal": None,
                       "error": "x" * 500 + "torch.OutOfMemoryError: CUDA out of memory"}},
             {"data": {"slot": "trainer-1", "wid": "w4", "exit_code": None, "signal": "SIGABRT"}}]
    assert worker_errors(exits) == [
        {"slot": "trainer-0", "exit_code": 1, "signal": None,
         "error": ("x" * 500 + "torch.OutOfMemoryError: CUDA out of memory")[-400:]},
        {"slot": "trainer-1", "exit_code": None, "signal": "SIGABRT", "error": ""}]
    good = {"state": "succeeded", "steps": 10, "steps_done": 10, "trajectories_lost": 0, "limit_s": 300.0,
            "timed_out": False, "faults": {"trainer_crash": {"recovered_at": 1.0}, "rollout_crash": {"recovered_at": None}}}
    assert missed_goals(good) == []
    assert missed_goals({**good, "state": "failed", "steps_done": 6}) == ["the job ended 'failed' after 6 of 10 steps"]
    assert missed_goals({**good, "state": "running", "steps_done": 7, "timed_out": True}) == [
        "the job was still running after 300 s, at step 7 of 10"]
    assert missed_goals({**good, "trajectories_lost": 3}) == ["3 trajectories lost"]
    assert missed_goals({**good, "faults": {**good["faults"], "rollout_crash": None}}) == [
        "the rollout crash was never injected"]


def test_nccl_stall_program_parses_its_arguments() -> None:
    from rlctl.gpucheck.nccl_stall import parse_args

    args = parse_args(["--rank", "1", "--world", "2", "--port", "29500", "--timeout-s", "5", "--mode", "peer-absent"])
    assert (args.rank, args.world, args.mode, args.hold_s) == (1, 2, "peer-absent", 120.0)


@pytest.mark.timeout(300)
def test_the_data_parallel_part_compares_a_real_group_with_a_single_run_on_cpu() -> None:
    from rlctl.gpucheck.dp_part import compare_group_with_single

    # The same code the GPU check runs over NCCL, here over gloo: ranks bit-identical, close to one process.
    figures = compare_group_with_single("cpu")
    assert figures["rank_weight_gap"] == 0.0 and figures["worst_gap_vs_single"] <= 0.05, figures
    assert [len(pair) for pair in figures["losses_group_vs_single"]] == [2, 2]


@pytest.mark.timeout(300)
def test_the_fsdp_part_compares_a_real_sharded_group_with_a_single_run_on_cpu() -> None:
    from rlctl.gpucheck.dp_part import compare_group_with_single

    # The GPU check's FSDP2 part, here over gloo: rank 0's gathered weights close to one process.
    figures = compare_group_with_single("cpu", "fsdp")
    assert figures["worst_gap_vs_single"] <= 0.05, figures
    assert [len(pair) for pair in figures["losses_group_vs_single"]] == [2, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_the_sharded_transfer_part_assembles_two_ranks_shards_bit_exact_on_cpu(transport: str) -> None:
    import torch

    from rlctl.gpucheck.ucx_part import sharded_round_trip
    from rlctl.weights.transport_ucx import ucxx_importable

    if transport == "ucx" and not ucxx_importable():
        pytest.skip("ucxx is not importable (the 'ucx' extra)")
    # The GPU check's ucx_cuda_shards part with its tensors on the CPU: two row shards, one source, one whole.
    figures = sharded_round_trip(torch, "cpu", transport, 8 * 2**20)
    assert figures["bit_exact"] and figures["ranks"] == 2 and figures["transport"] == transport
    assert figures["bytes"] >= 8 * 2**20 and figures["sharded_fetch_gbps"] > 0


def _decode_figures_meeting_goals() -> dict[str, Any]:
    from rlctl.gpucheck.decode_part import AGREEMENT_GOAL, DECODE_BATCHES, DECODE_STEP_GOAL_MS, SPEEDUP_GOAL

    return {"fast_path": "graph",
            "decode_ms_per_step": {"graph": {str(b): DECODE_STEP_GOAL_MS for b in DECODE_BATCHES},
                                   "eager": {str(b): 3.5 for b in DECODE_BATCHES}},
            "decode_path_by_batch": {"graph": {str(b): "graph" for b in DECODE_BATCHES},
                                     "eager": {str(b): "eager" for b in DECODE_BATCHES}},
            "tokens_per_s": {shape: {"speedup_vs_cpu": SPEEDUP_GOAL} for shape in ("default", "large")},
            "agreement": {"identical_rows": AGREEMENT_GOAL}}


def test_a_decode_figure_short_of_its_goal_fails_the_part() -> None:
    from rlctl.gpucheck.decode_part import assert_goals

    good = _decode_figures_meeting_goals()
    assert run_part("torch_decode", lambda: assert_goals(good))["status"] == "ok"
    slow_step, slow_rollout, different = _decode_figures_meeting_goals(), _decode_figures_meeting_goals(), \
        _decode_figures_meeting_goals()
    slow_step["decode_ms_per_step"]["graph"]["128"] = 1.2
    slow_rollout["tokens_per_s"]["large"]["speedup_vs_cpu"] = 2.9
    different["agreement"]["identical_rows"] = 0.5
    not_captured = _decode_figures_meeting_goals()  # fast enough, but a capture failed: its cause is the finding
    not_captured["decode_path_by_batch"]["graph"]["8"] = "static: RuntimeError: operation not permitted"
    for figures, words in ((slow_step, "batch 128: 1.2 ms"), (slow_rollout, "large: 2.9x"), (different, "50%"),
                           (not_captured, "batch 8 ran on the static: RuntimeError: operation not permitted path")):
        result = run_part("torch_decode", lambda figures=figures: assert_goals(figures))
        assert result["status"] == "failed" and words in result["error"], result["error"]
        assert result["decode_ms_per_step"] == figures["decode_ms_per_step"]  # the figures stay in the report


@pytest.mark.timeout(300)
def test_the_decode_part_compares_the_static_and_eager_paths_on_cpu() -> None:
    import torch

    from rlctl.gpucheck.decode_part import CPU_TWIN, decode_figures, missed_goals

    # The GPU check's torch_decode part on CPU: the static path without graphs, goals not asserted.
    figures = decode_figures(torch, CPU_TWIN)
    assert figures["agreement"]["identical_rows"] == 1.0  # on CPU the two paths sample the same tokens
    steps = figures["decode_ms_per_step"]
    assert set(steps) == {"static", "eager"} and all(set(costs) == {"1", "4"} for costs in steps.values())
    assert figures["decode_path_by_batch"] == {"static": {"1": "static", "4": "static"}, "eager": {"1": "eager", "4": "eager"}}
    assert all(ms > 0 for costs in steps.values() for ms in costs.values())
    for rates in figures["tokens_per_s"].values():
        assert [rates[path]["decode_path"] for path in ("cpu", "static", "eager")] == ["eager", "static", "eager"]
        assert rates["speedup_vs_cpu"] > 0 and rates["speedup_vs_eager"] > 0
    assert set(figures["tokens_per_s"]) == {"default", "large"}
    assert figures["missed_goals"] == missed_goals(figures)
