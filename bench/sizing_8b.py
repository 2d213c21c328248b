"""The 8B example's sizing plan at its real numbers, sharded (FSDP2) against unsharded data parallel.

The plan ``rlctl launch --dry-run`` prints for ``examples/qwen3-8b-gsm8k-slurm.toml``, computed from
Qwen3-8B's published architecture (its config.json numbers; no weights are needed for the
estimate, and none can be downloaded here). Baseline in the same run: the same job with
``[workload] sharding = "ddp"`` (every rank holds the whole model and optimizer).

    python bench/sizing_8b.py

Prints both plans to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.core.sizing import GIB, ModelShape, plan_sizes
from rlctl.spec_loader import load_job_file

EXAMPLE = ROOT / "examples" / "qwen3-8b-gsm8k-slurm.toml"
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "attention_bias": False}
GPU_GIB = 80  # an H100/A100 80 GB


def main() -> None:
    shape = ModelShape.from_hf_config(QWEN3_8B)
    plans = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in ("fsdp", "ddp"):
            job = Path(tmp) / f"{sharding}.toml"
            job.write_text(EXAMPLE.read_text().replace('engine = "vllm"', f'engine = "vllm"\nsharding = "{sharding}"'))
            plans[sharding] = plan_sizes(load_job_file(job), shape)
            print(f"[sizing_8b] sharding = {sharding}", *plans[sharding].lines(), sep="\n", file=sys.stderr)
    trainer = {name: plan.roles[0].total_per_gpu / GIB for name, plan in plans.items()}
    print(json.dumps({
        "model": "Qwen3-8B (published architecture)", "params": shape.params,
        "trainer_gib_per_gpu": {name: round(value, 2) for name, value in trainer.items()},
        "trainer_parts_gib": {name: {k: round(v / GIB, 2) for k, v in plan.roles[0].bytes_per_gpu.items()}
                              for name, plan in plans.items()},
        "rollout_gib_per_gpu": round(plans["fsdp"].roles[1].total_per_gpu / GIB, 2),
        "weight_sync_gib_per_step": round(plans["fsdp"].weight_sync_bytes_per_step / GIB, 1),
        "fits_80gb": {name: value < GPU_GIB for name, value in trainer.items()},
        "sharded_vs_ddp": round(trainer["fsdp"] / trainer["ddp"], 3),
    }))


if __name__ == "__main__":
    main()
