"""Warm-start caching: trained once per (seed, config), reused while the hash matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlctl.workload import warmstart
from rlctl.workload.model import GPT, ModelConfig, load_model
from rlctl.workload.warmstart import WarmStartConfig, config_hash, prepare_initial_checkpoint

TINY = WarmStartConfig(model=ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=256), steps=4,
                       batch_size=8, dataset_size=64, warmup_steps=2)


def test_prepare_trains_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "init.pt"
    assert prepare_initial_checkpoint(target, seed=1, config=TINY) == target
    sidecar = json.loads((tmp_path / "init.pt.json").read_text())
    assert sidecar["config_hash"] == config_hash(1, TINY)
    assert sidecar["final_loss"] < sidecar["first_loss"]
    model = load_model(target)
    assert isinstance(model, GPT) and model.config == TINY.model

    def must_not_train(seed: int, config: WarmStartConfig) -> None:
        raise AssertionError("cached warm-start was retrained")

    monkeypatch.setattr(warmstart, "train_supervised", must_not_train)
    prepare_initial_checkpoint(target, seed=1, config=TINY)
    with pytest.raises(AssertionError, match="retrained"):
        prepare_initial_checkpoint(target, seed=2, config=TINY)  # another seed: another hash


def test_supervised_training_is_deterministic() -> None:
    first, _ = warmstart.train_supervised(3, TINY)
    second, _ = warmstart.train_supervised(3, TINY)
    for key, value in first.state_dict().items():
        assert (second.state_dict()[key] == value).all()


def test_batches_are_length_bucketed() -> None:
    import random

    from rlctl.workload.task import make_dataset

    batches = warmstart.length_bucketed_batches(make_dataset(200, 0), 20, random.Random(0))
    spans = [max(len(p.tokens) + p.meta["expected_len"] for p in b) - min(len(p.tokens) + p.meta["expected_len"] for p in b)
             for b in batches]
    assert sum(len(b) for b in batches) == 200 and sorted(spans)[len(spans) // 2] <= 4


def test_family_mix_is_part_of_the_recipe_and_default_recipes_keep_their_hash() -> None:
    default = WarmStartConfig(steps=5)
    assert "mix" not in default.to_dict()  # caches made before the field existed stay valid
    counting = WarmStartConfig(steps=5, mix={"add": 0.2, "spell": 0.2, "count": 0.6})
    assert config_hash(0, counting) != config_hash(0, default)
    assert config_hash(0, counting) == config_hash(0, WarmStartConfig(steps=5, mix={"count": 0.6, "add": 0.2, "spell": 0.2}))


def test_length_alpha_is_part_of_the_recipe_and_reaches_the_data() -> None:
    assert "length_alpha" not in WarmStartConfig(steps=5).to_dict()
    heavier = WarmStartConfig(steps=5, length_alpha=0.2)
    assert config_hash(0, heavier) != config_hash(0, WarmStartConfig(steps=5))

    from rlctl.workload.task import length_stats, make_dataset

    default_tail = length_stats(make_dataset(2000, 0, mix={"down": 1.0}))
    heavy_tail = length_stats(make_dataset(2000, 0, mix={"down": 1.0}, length_alpha=heavier.length_alpha))
    assert heavy_tail["p50"] >= 5 * default_tail["p50"], (default_tail, heavy_tail)
