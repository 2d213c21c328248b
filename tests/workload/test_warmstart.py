"""The supervised warm-start of an HF folder: trained once per recipe, reused while the hash
matches, deterministic, and the task mix / long-answer shape are part of the recipe."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from rlctl.workload import hf_warmstart
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.hf_warmstart import SIDECAR, HFWarmStartConfig, examples, prepare_warmstart, recipe_hash
from tests.hf_models import tiny_model

TINY = HFWarmStartConfig(steps=8, batch_size=8, task_prompts=64, warmup_steps=2)


def test_prepare_trains_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tiny_model("qwen3"), tmp_path / "warm"
    assert prepare_warmstart(source, target, None, 1, TINY) == target
    sidecar = json.loads((target / SIDECAR).read_text())
    assert sidecar["recipe_hash"] == recipe_hash(source, None, 1, TINY)
    assert sidecar["final_loss"] < sidecar["first_loss"]
    assert load_hf_policy(target).config.model_type == "qwen3" and (target / "tokenizer.json").is_file()

    def must_not_train(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached warm-start was retrained")

    monkeypatch.setattr(hf_warmstart, "train", must_not_train)
    prepare_warmstart(source, target, None, 1, TINY)
    with pytest.raises(AssertionError, match="retrained"):
        prepare_warmstart(source, target, None, 2, TINY)  # another seed: another hash


def test_supervised_training_is_deterministic(tmp_path: Path) -> None:
    source = tiny_model("qwen3")
    hf_warmstart.train(source, tmp_path / "a", None, 3, TINY)
    hf_warmstart.train(source, tmp_path / "b", None, 3, TINY)
    first, second = load_hf_policy(tmp_path / "a").state_dict(), load_hf_policy(tmp_path / "b").state_dict()
    for key, value in first.items():
        assert torch.equal(second[key], value), key


def test_family_mix_and_length_alpha_are_part_of_the_recipe() -> None:
    source = tiny_model("qwen3")
    default = HFWarmStartConfig(steps=5)
    counting = HFWarmStartConfig(steps=5, mix={"add": 0.2, "spell": 0.2, "count": 0.6})
    assert recipe_hash(source, None, 0, counting) != recipe_hash(source, None, 0, default)
    assert recipe_hash(source, None, 0, counting) == recipe_hash(
        source, None, 0, HFWarmStartConfig(steps=5, mix={"count": 0.6, "add": 0.2, "spell": 0.2}))
    assert recipe_hash(source, None, 0, HFWarmStartConfig(steps=5, length_alpha=0.2)) != recipe_hash(
        source, None, 0, default)


def test_length_alpha_reaches_the_examples() -> None:
    source = tiny_model("qwen3")
    default_tail = examples(source, None, 0, 2000, mix={"down": 1.0})
    heavy_tail = examples(source, None, 0, 2000, mix={"down": 1.0}, length_alpha=0.2)
    default_p50 = statistics.median(len(e.response_ids) for e in default_tail)
    heavy_p50 = statistics.median(len(e.response_ids) for e in heavy_tail)
    assert heavy_p50 >= 3 * default_p50, (default_p50, heavy_p50)


def test_batches_are_length_bucketed() -> None:
    import random

    data = examples(tiny_model("qwen3"), None, 0, 400)
    batches = hf_warmstart.length_bucketed_batches(data, 20, random.Random(0))
    spans = [max(len(e.prompt_ids) + len(e.response_ids) for e in b) - min(len(e.prompt_ids) + len(e.response_ids) for e in b)
             for b in batches]
    assert sum(len(b) for b in batches) == 400 and sorted(spans)[len(spans) // 2] <= 4
