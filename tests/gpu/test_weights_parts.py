"""The GPU check's weight parts (``weights_stage``, ``weights_pull_local``) on the CPU: the same
publish, pull and load code at small sizes, checked for correctness and for every figure and lane
the GPU report carries; and their goal rules, which fail a part whose figure is short."""

from __future__ import annotations

from typing import Any

import pytest

from rlctl.gpucheck.report import PART_NAMES, run_part
from rlctl.weights.lanes import LANE_CLASSES


def test_the_parts_are_in_the_check() -> None:
    assert {"weights_stage", "weights_pull_local"} <= set(PART_NAMES)


@pytest.mark.timeout(120)
def test_the_stage_part_publishes_into_two_reused_buffers_loads_back_bit_exact_and_refuses_two_devices() -> None:
    import torch

    from rlctl.gpucheck.weights_part import CPU_STAGE, stage_figures, stage_missed

    figures = stage_figures(torch, CPU_STAGE)
    assert figures["bit_exact"] and figures["bytes"] >= CPU_STAGE.nbytes * 0.9
    assert [p["version"] for p in figures["publishes"]] == [1, 2, 3]
    assert figures["pool_buffers"] == 2 and figures["pool_allocations"] == 2  # the third publish reused the first
    assert all(p["chunks"] >= 1 and p["copy_gbps"] > 0 and p["device"] == "cpu" for p in figures["publishes"])
    assert figures["stage_gbps"] > 0 and figures["publish_gbps"] > 0 and figures["load_gbps"] > 0
    refused = figures["bad_input_refused"]
    assert "is on meta but tensor 'layers.0.weight' is on cpu" in refused["publish"], refused
    assert "is on meta but tensor 'layers.0.weight' is on cpu" in refused["load"], refused
    assert figures["missed_goals"] == stage_missed(figures)  # on the CPU the GB/s goals are reported, not met


@pytest.mark.timeout(240)
def test_the_pull_part_pulls_both_shapes_in_another_process_bit_exact_and_names_the_lane() -> None:
    import torch

    from rlctl.gpucheck.weights_part import CPU_PULL, pull_figures, pull_missed, state_nbytes

    figures = pull_figures(torch, CPU_PULL)
    assert set(figures["shapes"]) == set(CPU_PULL.shapes)
    for name, shape in figures["shapes"].items():
        assert shape["bit_exact"] and shape["bytes"] == state_nbytes(CPU_PULL.shapes[name]), (name, shape)
        assert shape["lane"] in LANE_CLASSES and shape["lanes"], shape
        assert shape["path"] == "shm" and shape["lanes"] == ["memfd/host"], shape  # the holder's memory file
        assert shape["end_to_end_gbps"] > 0 and shape["transfer_gbps"] > 0
        baseline = shape["transport_pull"]  # the same pull over the holder's transport, for comparison
        assert baseline["bit_exact"] and baseline["path"] in ("tcp", "ucx", "ucx-sm") and baseline["lanes"], baseline
        if figures["transport"] == "ucx":  # the holder kept a device copy: pulled into device memory (here: the CPU)
            on_device = shape["device_pull"]
            assert on_device["bit_exact"] and on_device["path"] == "ucx-sm" and on_device["lane"] in LANE_CLASSES
            assert on_device["lanes"] and on_device["end_to_end_gbps"] > 0, on_device
        else:
            assert "device_pull" not in shape
    assert figures["missed_goals"] == pull_missed(figures)


def _stage_meeting_goals() -> dict[str, Any]:
    from rlctl.gpucheck.weights_part import LOAD_GOAL_GBPS, STAGE_GOAL_GBPS

    return {"stage_gbps": STAGE_GOAL_GBPS, "load_gbps": LOAD_GOAL_GBPS, "bit_exact": True,
            "bad_input_refused": {"publish": "tensor 'a' is on cpu", "load": "tensor 'a' is on cpu"}}


def _pull_meeting_goals(lane: str = "sm", gbps: float = 20.0) -> dict[str, Any]:
    shape = {"bit_exact": True, "lane": lane, "lanes": ["cma/memory"], "end_to_end_gbps": gbps, "mismatched": []}
    on_device = {**shape, "lane": "cuda_ipc", "lanes": ["cuda_ipc/cuda"], "end_to_end_gbps": 150.0}
    return {"device": "cuda", "ucx_cuda_memory": {"cuda_support": True, "cuda_transports": ["cuda_copy", "cuda_ipc"]},
            "shapes": {"0.5b": {**shape, "bytes": 987_922_688, "device_pull": dict(on_device)},
                       "8b": {**shape, "bytes": 16_381_249_536, "device_pull": dict(on_device)}}}


def test_a_weights_figure_short_of_its_goal_fails_the_part_and_keeps_the_figures() -> None:
    from rlctl.gpucheck.weights_part import _asserted, pull_missed, stage_missed

    assert stage_missed(_stage_meeting_goals()) == [] and pull_missed(_pull_meeting_goals()) == []
    slow_stage, slow_load, not_refused = _stage_meeting_goals(), _stage_meeting_goals(), _stage_meeting_goals()
    slow_stage["stage_gbps"], slow_load["load_gbps"] = 39.9, 12.0
    not_refused["bad_input_refused"]["load"] = ""
    slow_pull, ipc_pull, unnamed = _pull_meeting_goals(gbps=19.5), _pull_meeting_goals("cuda_ipc", 60.0), _pull_meeting_goals()
    small_and_slow = _pull_meeting_goals()  # the 1 GB shape's rates are reported, not asserted
    small_and_slow["shapes"]["0.5b"]["end_to_end_gbps"] = small_and_slow["shapes"]["0.5b"]["device_pull"]["end_to_end_gbps"] = 5.0
    assert pull_missed(small_and_slow) == []
    unnamed["shapes"]["8b"]["lanes"] = []
    slow_device, no_device_pull = _pull_meeting_goals(), _pull_meeting_goals()
    slow_device["shapes"]["8b"]["device_pull"]["end_to_end_gbps"] = 99.0
    del no_device_pull["shapes"]["0.5b"]["device_pull"]
    wrong_baseline = _pull_meeting_goals()
    wrong_baseline["shapes"]["0.5b"]["transport_pull"] = {"bit_exact": False, "mismatched": ["lm_head.weight"],
                                                          "end_to_end_gbps": 1.0}
    cases = [(slow_stage, stage_missed, "staging 39.9 GB/s < 40"), (slow_load, stage_missed, "load 12.0 GB/s < 40"),
             (not_refused, stage_missed, "was not refused"), (slow_pull, pull_missed, "8b: 19.5 GB/s end to end"),
             (ipc_pull, pull_missed, "over cuda_ipc < 100"), (unnamed, pull_missed, "8b: the pull named no lane"),
             (slow_device, pull_missed, "8b into device memory: 99.0 GB/s end to end over cuda_ipc < 100"),
             (no_device_pull, pull_missed, "0.5b: UCX here carries GPU memory but no device-memory pull ran"),
             (wrong_baseline, pull_missed, "0.5b over the transport: the loaded state differs")]
    for figures, rule, words in cases:
        result = run_part("weights", lambda figures=figures, rule=rule: _asserted(figures, rule(figures)))
        assert result["status"] == "failed" and words in result["error"], result["error"]
        assert {k: v for k, v in result.items() if k in figures} == figures  # the figures stay in the report


def test_the_pull_parts_model_states_are_the_real_models_tensors_and_sizes() -> None:
    """The states the part publishes have the tensors transformers builds for Qwen2.5-0.5B and
    Qwen3-8B (``param_layout``), and as many bytes as the sizing plan counts for them."""
    from rlctl.core.sizing import ModelShape
    from rlctl.gpucheck.weights_part import SHAPES, state_nbytes, state_specs

    configs = {"0.5b": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
                        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                        "tie_word_embeddings": True},
               "8b": {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                      "tie_word_embeddings": False}}
    for name, config in configs.items():
        assert state_nbytes(SHAPES[name]) == 2 * ModelShape.from_hf_config(config).params, name
    names = dict(state_specs(SHAPES["0.5b"]))
    assert "lm_head.weight" not in names and names["model.layers.0.self_attn.k_proj.bias"] == (128,)
    assert dict(state_specs(SHAPES["8b"]))["model.layers.35.self_attn.q_norm.weight"] == (128,)
    assert round(state_nbytes(SHAPES["0.5b"]) / 1e9, 2) == 0.99 and round(state_nbytes(SHAPES["8b"]) / 1e9, 1) == 16.4
