"""A model folder whose model.safetensors is 100 random bytes: `rlctl model check`, `rlctl launch
--dry-run` and `rlctl launch` of a real local job on it all exit 2 naming the file and the reason,
and nothing is started (no job directory, no controller, no worker)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from tests.hf_models import gsm8k_data, tiny_model
from tests.integration.helpers import kill_everything_under, processes_under, rlctl, write_job


def user_tables(model: Path) -> str:
    data = gsm8k_data()
    return f"""
[model]
path = "{model}"

[data]
train_files = ["{data / 'train.parquet'}"]

[reward]
function = "gsm8k"
timeout_s = 1.0
"""


def test_a_corrupt_weight_file_is_refused_by_check_dry_run_and_launch(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), model)
    weights = model / "model.safetensors"
    weights.write_bytes(random.Random(0).randbytes(100))
    job_file = write_job(tmp_path / "job", name="corrupt", steps=2, spares=0, extra_tables=user_tables(model))
    state = tmp_path / "jobs"
    reason = f"{weights}: header length "
    try:
        checked = rlctl(state, "model", "check", str(model), check=False)
        assert checked.returncode == 2, checked.stdout + checked.stderr
        assert reason in checked.stderr and "exceeds the file (100 bytes)" in checked.stderr

        for args in (("--dry-run",), ("--dry-run", "--json"), (), ("--json",)):
            launched = rlctl(state, "launch", str(job_file), *args, check=False)
            assert launched.returncode == 2, (args, launched.stdout, launched.stderr)
            assert f"{job_file}: [model] path: {reason}" in launched.stderr, launched.stderr
            assert "exceeds the file (100 bytes)" in launched.stderr
            assert not state.exists() or not any(state.iterdir()), list(state.iterdir())

        listed = rlctl(state, "status", "--json", check=False)
        assert listed.returncode != 0 and f"no jobs under {state}" in listed.stderr
        assert not processes_under(state) and not processes_under(job_file.parent)

        intact = write_job(tmp_path / "intact", name="intact", steps=2, spares=0, extra_tables=user_tables(tiny_model()))
        planned = rlctl(state, "launch", str(intact), "--dry-run", check=False)
        assert planned.returncode == 0, planned.stderr  # the same job on the intact model is launchable
        assert "weights: 46 tensors in 1 file(s) match Qwen3ForCausalLM (config.json)" in planned.stdout
    finally:
        kill_everything_under(tmp_path)
