"""The launch checks a user's model folder, data and reward function before anything starts, and
the controller's prompts come from them: tokenized with the chat template, deterministic ids."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.spec_loader import load_job_file
from rlctl.workload.hf_tokenizer import ChatTokenizer
from rlctl.workload.prompts import PreflightError, load_prompt_set, preflight
from tests.hf_models import gsm8k_data, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, model: str, train: str, reward: str = 'function = "gsm8k"', extra: str = "") -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f"""
[job]
name = "user-job"
steps = 2
[cluster]
backend = "local"
[model]
path = "{model}"
max_prompt_tokens = 64
[data]
train_files = ["{train}"]
[reward]
{reward}
[rollout]
batch_prompts = 4
group_size = 2
{extra}
""")
    return path


def _dry_run(job: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlctl.cli", "launch", str(job), *args],
                          env={"RLCTL_HOME": str(state), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120, check=False)


def test_prompts_are_the_rows_through_the_chat_template(tmp_path: Path) -> None:
    model, data = tiny_model(), gsm8k_data()
    spec = load_job_file(_job(tmp_path, str(model), str(data / "train.parquet")))
    prompts = load_prompt_set(spec)
    assert len(prompts.prompts) + prompts.too_long == 400
    assert prompts.prompts == load_prompt_set(spec).prompts  # a resumed controller rebuilds the same set
    first = prompts.prompts[0]
    assert first.prompt_id == "d0" and first.meta["data_source"] == "openai/gsm8k"
    text = ChatTokenizer(model).decode(first.tokens, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nWhat is") and text.endswith("<|im_start|>assistant\n")
    assert preflight(spec)["train_files"] == {"prompts": len(prompts.prompts), "too_long": prompts.too_long,
                                              "truncated": 0}


def test_relative_paths_are_read_from_the_job_files_folder(tmp_path: Path) -> None:
    shutil.copytree(tiny_model(), tmp_path / "models" / "tiny")
    shutil.copy(gsm8k_data() / "train.parquet", tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text("def compute_score(a, b, c, d=None):\n    return 0.0\n")
    spec = load_job_file(_job(tmp_path, "models/tiny", "train.parquet", 'path = "reward.py"'))
    assert spec.model["path"] == str(tmp_path / "models" / "tiny")
    assert spec.reward["path"] == str(tmp_path / "reward.py")
    assert preflight(spec)["reward"] == f"{tmp_path / 'reward.py'}:compute_score"


def test_every_problem_is_named(tmp_path: Path) -> None:
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text(json.dumps({"prompt": "x", "data_source": "d"}) + "\n")
    spec = load_job_file(_job(tmp_path, str(tmp_path / "no-model"), str(bad_rows), 'function = "nope.mod:fn"'))
    with pytest.raises(PreflightError) as caught:
        preflight(spec)
    [model_problem, reward_problem] = caught.value.problems
    assert str(tmp_path / "no-model") in model_problem and "config.json" in model_problem and "tokenizer.json" in model_problem
    assert "nope.mod:fn" in reward_problem

    spec = load_job_file(_job(tmp_path, str(tiny_model()), str(bad_rows)))
    with pytest.raises(PreflightError) as caught:
        preflight(spec)
    assert str(bad_rows) in str(caught.value) and "row 0" in str(caught.value) and "reward_model.ground_truth" in str(caught.value)

    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"prompt": "x", "data_source": "d", "reward_model": {"ground_truth": "1"}}) + "\n")
    spec = load_job_file(_job(tmp_path, str(tiny_model()), str(few)))
    with pytest.raises(PreflightError, match="1 usable prompts .* expected at least one batch"):
        preflight(spec)


def test_launch_refuses_bad_input_and_starts_nothing(tmp_path: Path) -> None:
    state = tmp_path / "jobs"
    model, data = tiny_model(), gsm8k_data()
    no_weights = tmp_path / "no-weights"
    shutil.copytree(model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    for job in (_job(tmp_path, str(no_weights), str(data / "train.parquet")),
                _job(tmp_path, str(model), str(data / "missing.parquet")),
                _job(tmp_path, str(model), str(data / "train.parquet"), 'function = "nowhere/reward.py:fn"')):
        result = _dry_run(job, state)
        assert result.returncode == 2, result.stderr
        assert "error:" in result.stderr and str(job) in result.stderr
        assert not state.exists() or not any(state.iterdir())  # nothing half-started
    assert "model.safetensors" in _dry_run(_job(tmp_path, str(no_weights), str(data / "train.parquet")), state).stderr


def test_dry_run_shows_the_checked_workload(tmp_path: Path) -> None:
    job = _job(tmp_path, str(tiny_model()), str(gsm8k_data() / "train.parquet"))
    result = _dry_run(job, tmp_path / "jobs", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["checks"]["model"]["model_type"] == "qwen3" and out["checks"]["reward"] == "gsm8k"
    assert "data train_files:" in out["plan"]
    assert not (tmp_path / "jobs").exists()
