"""Cost-model files, failure traces and calibration against a real local chaos run's journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlctl.sim.calibrate import _trace, load_trace, measure_cost_model, predict_from_events, read_events
from rlctl.sim.costmodel import (
    CostModel,
    CostModelError,
    cost_model_from_dict,
    cost_model_to_toml,
    load_cost_model,
    normal_quantile,
    response_cdf,
    response_quantile,
)
from rlctl.sim.faults import LLAMA3_RATE_PER_GPU_HOUR, parse_duration
from rlctl.specfile import load_job_file
from tests.sim.conftest import DATA, ROOT


def test_the_example_cost_model_loads_and_equals_the_defaults() -> None:
    assert load_cost_model(ROOT / "examples" / "cost_model.toml") == CostModel()


def test_rendered_defaults_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    path.write_text(cost_model_to_toml(CostModel()))
    assert load_cost_model(path) == CostModel()


@pytest.mark.parametrize("data,needle", [({"nope": {}}, "unknown section"), ({"step": {"trian_s": 1.0}}, "unknown key"),
                                         ({"step": {"train_s": "x"}}, "expected a number"),
                                         ({"cluster": {"gpus_per_node": 2.5}}, "expected an integer"),
                                         ({"step": {"train_s": -1.0}}, ">= 0")])
def test_bad_cost_models_name_the_key(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(CostModelError, match=needle):
        cost_model_from_dict(data, "cost.toml")


def test_length_distribution_quantiles_invert_the_cdf() -> None:
    gen = CostModel().generation
    for p in (0.01, 0.5, 0.9, 0.999):
        assert response_cdf(gen, response_quantile(gen, p)) == pytest.approx(p, abs=1e-6)
    assert normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-5)


def test_llama3_rate_and_durations() -> None:
    assert LLAMA3_RATE_PER_GPU_HOUR == pytest.approx(419 / (16384 * 54 * 24))
    assert parse_duration("24h") == 86400 and parse_duration("7d") == 7 * 86400 and parse_duration(90) == 90


def test_trace_files_load(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"at": "2h", "kind": "xid", "code": 79, "role": "trainer"}\n{"at": 30, "kind": "crash"}\n')
    faults = load_trace(path)
    assert [f.at for f in faults] == [30.0, 7200.0] and faults[1].params == {"code": 79}
    path.write_text(json.dumps([{"at": 1, "kind": "meteor"}]))
    with pytest.raises(ValueError, match="unknown fault kind"):
        load_trace(path)


def test_calibration_predicts_a_real_runs_ettr_within_five_points() -> None:
    """The journal of a real local run (quickstart, 14 steps, a rollout and a trainer crash injected)."""
    events = read_events(DATA / "chaos_journal.jsonl")
    spec = load_job_file(DATA / "chaos_job.toml")
    assert [f.kind for f in _trace(events)] == ["crash", "crash"]
    cost = measure_cost_model(events, spec)
    assert 0 < cost.step.train_s < 30 and cost.init.trainer_s > 1
    result = predict_from_events(events, spec)
    assert result["predicted"]["steps"] == result["measured"]["steps"]
    assert result["within_5_points"], result
