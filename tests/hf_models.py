"""Tiny Hugging Face checkpoints and GSM8K-layout data for tests, made here and cached.

Folders live under ``$RLCTL_CACHE/test-models`` (the test command sets it inside the checkout),
keyed by what made them, and appear whole (made in a staging folder, then renamed), so parallel
or repeated runs reuse them; a file lock makes one process build a folder while others wait.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = 2  # bump when hf_init or gsm8k_layout change what they write


def cache_root() -> Path:
    root = Path(os.environ.get("RLCTL_CACHE", ROOT / ".cache" / "rlctl")) / "test-models"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _cached(name: str, build: Callable[[Path], object]) -> Path:
    target = cache_root() / f"v{VERSION}-{name}"
    if (target / ".complete").is_file():
        return target
    with open(cache_root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        (staging / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    return target


def tiny_model(arch: str = "qwen3", seed: int = 0) -> Path:
    """A random-init tiny model folder (``rlctl model init --arch ARCH --size tiny``)."""
    from rlctl.workload.hf_init import init_checkpoint

    return _cached(f"{arch}-tiny-{seed}", lambda path: init_checkpoint(path, arch, "tiny", seed))


def gsm8k_data(train_rows: int = 400, test_rows: int = 64) -> Path:
    """A folder with train.parquet and test.parquet in verl's GSM8K layout."""
    from rlctl.workload.gsm8k_layout import write_dataset

    return _cached(f"gsm8k-{train_rows}-{test_rows}", lambda path: write_dataset(path, train_rows, test_rows, 0))


def calculator_warm_model(warmstart_steps: int = 500) -> Path:
    """``calc.jsonl`` (calculator demonstrations) and ``model/`` (the tiny Llama warm-started on
    them): ``calculator_env.warm_started_calculator_model``."""
    from rlctl.workload.calculator_env import warm_started_calculator_model

    return _cached(f"calculator-warm-{warmstart_steps}",
                   lambda path: warm_started_calculator_model(tiny_model("llama"), path, steps=warmstart_steps))
