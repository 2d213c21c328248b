"""The 8B job a user would run on 256 GPUs stays valid: `rlctl launch --dry-run` renders it, the
sbatch scripts included, with a tiny model and data set standing in for the 8B and GSM8K."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlctl.spec_loader import load_job_file
from tests.hf_models import gsm8k_data, tiny_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-gsm8k-slurm.toml"


def test_the_8b_example_renders_with_its_sbatch_scripts(tmp_path: Path) -> None:
    data = gsm8k_data(train_rows=600)  # at least one batch of the example's 512 prompts
    text = EXAMPLE.read_text()
    for original, stand_in in (("/shared/models/Qwen3-8B", tiny_model()), ("/shared/data/gsm8k", data)):
        assert original in text
        text = text.replace(original, str(stand_in))
    job = tmp_path / "job.toml"
    job.write_text(text)
    spec = load_job_file(job)
    assert spec.nodes_needed == 32 and sum(r.nodes * r.gpus_per_node for r in spec.roles.values()) == 224
    result = subprocess.run([sys.executable, "-m", "rlctl.cli", "launch", str(job), "--dry-run", "--json"],
                            env={"RLCTL_HOME": str(tmp_path / "jobs"), "PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout.strip().splitlines()[-1])["plan"]
    assert "#SBATCH" in plan and "--exclusive" in plan and "--gres=gpu:8" in plan
    assert "reward: gsm8k" in plan and "data eval_files:" in plan
    assert "sizing (estimates" in plan and "trainer: 64 worker(s) on 8 node(s)" in plan, plan
    assert "rollout: 160 worker(s) on 20 node(s)" in plan and "weight sync per step:" in plan
    assert not (tmp_path / "jobs").exists()
