"""The sharded trainer group (FSDP2 over gloo, 2 ranks on CPU): the same first step as one process,
half the parameters held per rank, weights gathered for publishing on rank 0 only, and a sharded
checkpoint (optimizer shards per rank, one HF folder) that resumes like the uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.rendezvous import held_store
from rlctl.workload.trainer import OPTIMIZER_SHARDS_DIR

from .batches import small_model

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(300)


# Sequence-level aggregation over two mini-batches of two epochs: the group's updates need the whole
# mini-batch's sequence count, and the second update's ratio moves.
MINI_BATCHES = {"loss_agg_mode": "seq-mean-token-mean", "ppo_mini_batch_size": 2, "ppo_epochs": 2,
                "use_kl_loss": True, "kl_loss_coef": 0.05, "clip_ratio_high": 0.28}


def run_group(tmp_path: Path, tag: str, ranks: int, *args: str, recipes: list[dict] | None = None) -> list[Any]:
    with held_store() as rendezvous:
        procs = []
        for rank in range(ranks):
            env = {**os.environ, **rendezvous, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1",
                   "WORLD_SIZE": str(ranks), "RANK": str(rank), "RECIPES": json.dumps(recipes or [])}
            procs.append(subprocess.Popen([sys.executable, str(HERE / "fsdp_worker.py"), str(tmp_path / f"{tag}{rank}.pt"),
                                           *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=240)
            saved = (tmp_path / f"{tag}{rank}.pt").exists()
            assert proc.returncode == 0, f"rank {rank} (result saved: {saved}): {output.decode()[-3000:]}"
    return [torch.load(tmp_path / f"{tag}{rank}.pt", weights_only=False) for rank in range(ranks)]


def test_two_sharded_ranks_take_the_same_first_step_as_one_process(tmp_path: Path) -> None:
    recipes = [{"use_kl_loss": True, "kl_loss_coef": 0.05}, MINI_BATCHES]
    groups = run_group(tmp_path, "fsdp", 2, "first-step", recipes=recipes)
    alones = run_group(tmp_path, "alone", 1, "first-step", recipes=recipes)[0]
    for index, (rank0, rank1, alone) in enumerate(zip(groups[0], groups[1], alones, strict=True)):
        check_first_step([rank0, rank1], alone, mini_batches=index == 1)


def check_first_step(group: list[dict], alone: dict, mini_batches: bool) -> None:
    assert [r["sharded"] for r in group] == [True, True] and not alone["sharded"]
    assert group[1]["state"] == {}, "only rank 0 receives the gathered weights"
    initial = small_model(11).state_dict()
    for key, value in alone["state"].items():
        moved = (value - initial[key]).abs().max().item()
        # Several Adam updates turn float-level gradient differences into differences of the update's
        # size in weights whose gradient is noise: compared against the update itself.
        limit = max(1e-5, 0.05 * moved) if mini_batches else 1e-5
        assert (group[0]["state"][key] - value).abs().max().item() < limit, key
    moved = max((v - initial[k]).abs().max().item() for k, v in alone["state"].items())
    assert moved > 1e-4, "the step changed the weights"
    assert alone["metrics"]["updates"] == (4 if mini_batches else 1)
    total = sum(v.numel() for v in alone["state"].values())
    assert [r["held_elements"] for r in group] == pytest.approx([total / 2, total / 2], rel=0.05)
    assert group[0]["metrics"]["loss"] == pytest.approx(alone["metrics"]["loss"], abs=1e-6)
    assert group[0]["metrics"]["grad_norm"] == pytest.approx(alone["metrics"]["grad_norm"], rel=1e-5)


def test_a_sharded_checkpoint_resumes_like_the_uninterrupted_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step-000001"
    straight = run_group(tmp_path, "straight", 2, "checkpoint", str(checkpoint))
    shards = sorted(p.name for p in (checkpoint / OPTIMIZER_SHARDS_DIR).iterdir())
    assert any(name.endswith(".distcp") for name in shards) and ".metadata" in shards, shards
    exported = load_hf_policy(checkpoint).state_dict()  # one HF folder, loadable on its own
    assert exported.keys() <= straight[0]["state"].keys()
    resumed = run_group(tmp_path, "resumed", 2, "resume", str(checkpoint))
    assert resumed[0]["restored_step"] == 1
    worst = max((resumed[0]["state"][k] - v).abs().max().item() for k, v in straight[0]["state"].items())
    assert worst == 0.0, worst


def test_each_rank_resumes_from_its_own_part_of_the_state_like_the_uninterrupted_run(tmp_path: Path) -> None:
    """The warm standby's replica of a sharded group: each rank's part (shards of weights, reference
    and optimizer, its RNG), loaded by a fresh group without any checkpoint, steps on exactly as the
    group that kept running."""
    straight = run_group(tmp_path, "straight", 2, "rank-state", str(tmp_path))
    parts = [(tmp_path / f"rank-{rank}.pt").stat().st_size for rank in range(2)]
    resumed = run_group(tmp_path, "resumed", 2, "rank-resume", str(tmp_path))
    assert [r["restored_step"] for r in resumed] == [1, 1]
    worst = max((resumed[0]["state"][k] - v).abs().max().item() for k, v in straight[0]["state"].items())
    assert worst == 0.0, worst
    assert resumed[0]["metrics"]["loss"] == straight[0]["metrics"]["loss"]
    whole = sum(v.numel() * v.element_size() for v in straight[0]["state"].values())
    assert max(parts) < 0.75 * 4 * whole, f"a rank's part is its shard, not the whole state: {parts} vs {whole}"


def test_every_rank_serves_its_shard_and_a_pull_of_all_of_them_is_the_whole_model(tmp_path: Path) -> None:
    group = run_group(tmp_path, "shards", 2, "shards")
    pulled, gathered = group[0]["pulled"], group[0]["state"]
    assert pulled.keys() == gathered.keys() and group[1]["pulled"] == {}
    for name, tensor in gathered.items():
        assert torch.equal(pulled[name], tensor), name
