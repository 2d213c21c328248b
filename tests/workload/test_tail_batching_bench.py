"""``bench/tail_batching.py`` end to end at a tiny size: both arms run the real scheduler, engine and
trainer, the tail arm settles its long queue, and the last stdout line is the JSON figure object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_both_arms_and_prints_one_json_object(tmp_path: Path) -> None:
    env = {**os.environ, "RLCTL_CACHE": str(tmp_path), "RLCTL_TORCH_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tail_batching.py"), "--steps", "3", "--batch", "4", "--group", "2",
         "--worker-batch", "16", "--max-new", "48", "--short-cap", "8", "--dataset", "64", "--warmstart-steps", "20",
         "--eval-prompts", "6", "--device", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    sync, tail = figures["sync"], figures["tail_batching"]
    assert sync["rounds"] == {"sync": 3} and sync["drain_steps"] == 0
    assert set(tail["rounds"]) <= {"short", "long"} and sum(tail["rounds"].values()) == tail["steps"]
    assert tail["steps"] == 3 + tail["drain_steps"]
    for arm in (sync, tail):
        assert arm["trained_prompts"] >= 4 * 3
        assert arm["decode_steps_total"] > 0 and arm["generated_tokens_total"] >= arm["decode_steps_total"]
        assert 0.0 <= arm["eval_reward"] <= 1.0
        # Each arm's held-out gain over the initial policy, paired per prompt, with its standard error.
        assert arm["eval_gain"] == pytest.approx(arm["eval_reward"] - figures["eval_reward_initial"], abs=2e-4)
        assert arm["eval_gain_se"] >= 0
    assert figures["rollout_speedup"] > 0 and figures["decode_step_ratio"] > 0
    assert figures["config"]["long_family"] in ("count", "down")
    assert "[tail_batching] sync step 0" in result.stderr
