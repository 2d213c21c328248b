"""The sizing plan: parameter counts exact against the models transformers builds, and the 8B
example's plan at its real numbers (Qwen3-8B's published architecture)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlctl.core.sizing import GIB, ModelShape, SizingError, plan_sizes
from rlctl.spec_loader import load_job_file
from tests.hf_models import gsm8k_data, tiny_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-gsm8k-slurm.toml"

# Qwen3-8B's config.json as published with the model (architecture numbers only).
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "attention_bias": False}


def built_params(config: dict[str, Any]) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_parameter_count_is_exact_for_the_tiny_models(arch: str) -> None:
    config = json.loads((tiny_model(arch) / "config.json").read_text())
    assert ModelShape.from_hf_config(config).params == built_params(config)


def test_the_parameter_count_is_exact_with_attention_biases_and_tied_embeddings() -> None:
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True}
    assert ModelShape.from_hf_config(config).params == built_params(config)


def test_a_config_without_a_dimension_is_refused_by_key() -> None:
    with pytest.raises(SizingError, match="'num_hidden_layers'"):
        ModelShape.from_hf_config({k: v for k, v in QWEN3_8B.items() if k != "num_hidden_layers"})


def test_the_8b_example_fits_its_gpus_sharded_and_would_not_unsharded(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("/shared/models/Qwen3-8B", str(tiny_model())).replace(
        "/shared/data/gsm8k", str(gsm8k_data(train_rows=600)))
    job = tmp_path / "job.toml"
    job.write_text(text)
    spec = load_job_file(job)
    shape = ModelShape.from_hf_config(QWEN3_8B)
    assert shape.params == pytest.approx(8.19e9, rel=0.002)  # "8.2B" on the model card
    plan = plan_sizes(spec, shape)
    trainer, rollout = plan.roles[0], plan.roles[1]
    assert (trainer.workers, rollout.workers, plan.engines) == (64, 160, 160)
    assert plan.compute_dtype == "bfloat16"
    assert trainer.bytes_per_gpu["optimizer"] == 8 * shape.params // 64  # two fp32 moments, 1/64 each
    assert trainer.total_per_gpu < 80 * GIB, plan.lines()
    assert rollout.bytes_per_gpu["weights"] == shape.params * 2
    assert plan.weight_sync_bytes_per_step == 160 * shape.params * 2
    unsharded = plan_sizes(spec.__class__(**{**spec.__dict__, "raw": {**spec.raw, "workload": {
        **spec.raw["workload"], "sharding": "ddp"}}}), shape)
    assert unsharded.roles[0].total_per_gpu > 80 * GIB  # every rank holding it all would not fit an 80 GB GPU
