"""The reference job's model: a tiny Llama made and warm-started here when a job names no model.

Role: one workload path. A job without ``[model] path`` (the quickstart, the tests, the lab's
job) still runs a Hugging Face model: a random-init ``LlamaForCausalLM`` shaped by ``[workload]``
(``model_dim`` wide, ``layers`` deep, ``heads`` attention heads of head_dim 64, the vLLM CPU
build's constraint), with a tokenizer trained here, warm-started for ``warmstart_steps`` on the
reference task's answers so GRPO has a signal from the first step.

Why Llama and not Qwen3: at this size and budget Qwen3's query/key norms hold attention soft
for a long time, and the task needs sharp attention (copy the digits of the prompt). Measured with
the quickstart's shape and 600 warm-start steps: sampled reward 0.50 for Llama, 0.09 for Qwen3
(docs/figures.md). Users' Qwen3 checkpoints are trained the same way (tests run both).

``reference_model_dir`` is a pure function of the spec and the cache folder (``$RLCTL_CACHE``,
default ``~/.cache/rlctl``): the controller computes it and hands the absolute path to every
worker, so nobody else needs the cache. ``ensure_reference_model`` makes the folder (torch and
transformers; `rlctl launch` calls it before the controller starts) and is idempotent: a folder
holding its ``warmstart.json`` is complete and reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from rlctl.core.spec import JobSpec

RECIPE_VERSION = 2
REFERENCE_ARCH = "llama"
COMPLETE_MARK = "warmstart.json"


def cache_dir() -> Path:
    return Path(os.environ.get("RLCTL_CACHE", os.path.expanduser("~/.cache/rlctl")))


def recipe(spec: JobSpec) -> dict[str, Any]:
    """Everything that decides the reference model's bytes."""
    workload = spec.workload
    return {"recipe": RECIPE_VERSION, "arch": REFERENCE_ARCH, "seed": spec.seed, "hidden": int(workload["model_dim"]),
            "layers": int(workload["layers"]), "heads": int(workload["heads"]),
            "warmstart_steps": int(workload["warmstart_steps"])}


def reference_model_dir(spec: JobSpec) -> Path:
    digest = hashlib.sha256(json.dumps(recipe(spec), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"reference-{REFERENCE_ARCH}-{digest}"


def model_path_for(spec: JobSpec) -> Path:
    """The model folder the job trains: ``[model] path``, else the reference model's folder."""
    return Path(spec.model["path"]) if spec.hf_model else reference_model_dir(spec)


def is_ready(folder: Path) -> bool:
    return (folder / COMPLETE_MARK).is_file() and (folder / "config.json").is_file()


def ensure_reference_model(spec: JobSpec) -> Path:
    """Make the reference model folder unless it is there; blocking (about a minute the first
    time for the quickstart's size); several processes may ask at once (a file lock)."""
    target = reference_model_dir(spec)
    if is_ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(target):
            return target
        _build(spec, target)
    return target


def model_size(hidden: int, layers: int, heads: int) -> Any:
    """The reference model's shape for ``[workload]``'s width, depth and heads (``hf_init.ModelSize``)."""
    from rlctl.workload.hf_init import SIZES, ModelSize

    return ModelSize(hidden=hidden, layers=layers, heads=heads, kv_heads=heads, intermediate=3 * hidden,
                     vocab=SIZES["tiny"].vocab, max_positions=SIZES["tiny"].max_positions)


def _build(spec: JobSpec, target: Path) -> None:
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_warmstart import HFWarmStartConfig, train

    shape = recipe(spec)
    size = model_size(shape["hidden"], shape["layers"], shape["heads"])
    base = target.with_name(f".{target.name}.base-{os.getpid()}")
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        init_checkpoint(base, REFERENCE_ARCH, size, spec.seed)
        steps = shape["warmstart_steps"]
        if steps > 0:
            figures = train(base, staging, None, spec.seed, HFWarmStartConfig(steps=steps))
        else:
            shutil.copytree(base, staging)
            figures = {}
        (staging / COMPLETE_MARK).write_text(json.dumps({**shape, **figures}, indent=2, sort_keys=True))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
