"""``bench/recipes.py`` end to end at a tiny size: every recipe trains from the same model and seed
with its own ``[algorithm]`` (DAPO's dynamic sampling draws more prompts), each is evaluated on the
same held-out prompts as the initial policy, and the last stdout line is the JSON figure object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_bench_trains_every_recipe_and_prints_one_json_object() -> None:
    env = {**os.environ, "RLCTL_TORCH_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recipes.py"), "--seeds", "0", "1", "--steps", "2", "--batch", "4",
         "--group", "4", "--dataset", "64", "--eval-prompts", "6", "--eval-samples", "1", "--device", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    names = {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_plus_plus"}
    assert set(figures["recipes"]) == names
    for name, recipe in figures["recipes"].items():
        runs = [r for r in figures["runs"] if r["recipe"] == name]
        assert [r["seed"] for r in runs] == [0, 1]
        assert recipe["held_out_gain"] == pytest.approx(sum(r["held_out_gain"] for r in runs) / 2, abs=1e-4)
        assert recipe["held_out_gain_se"] >= 0 and isinstance(recipe["learns"], bool)
    for seed in (0, 1):  # the same held-out test for every recipe of a seed: the same reward before training
        assert len({r["held_out_before"] for r in figures["runs"] if r["seed"] == seed}) == 1
    assert figures["recipes"]["dapo"]["extra_generation"] >= 0
    assert all(figures["recipes"][n]["extra_generation"] == 0 for n in names - {"dapo"})
