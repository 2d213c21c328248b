"""A whole job whose rollout runs vLLM (`[workload] engine = "vllm"`) on the local backend: the
engine serves the job's HF folder, takes every published version in place from the weight
transport, and the job trains to the end. Runs in .venv-vllm (the vLLM tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.lab.reference_jobs import write_job
from tests.hf_models import tiny_model
from tests.integration.helpers import run_to_end

STEPS = 4


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_job_with_a_vllm_rollout_trains_every_step(tmp_path: Path) -> None:
    # The template ends with the [workload] table: the engine key lands in it.
    job_file = write_job(tmp_path, name="vllmjob", steps=STEPS, rollouts=1, spares=0, checkpoint_every=2, extra_tables=(
        'engine = "vllm"\n\n[model]\npath = "' + str(tiny_model("qwen3")) + '"\n\n[reward]\ntimeout_s = 2.0\n'))
    snap, events = run_to_end(tmp_path / "jobs", job_file, 600)
    assert snap["job"]["state"] == "succeeded" and snap["job"]["step"] == STEPS, snap["job"]
    rollout_slots = {e.data["slot"] for e in events if e.type == "WorkerStarting" and e.data["role"] == "rollout"}
    phases = [e.data["phase"] for e in events if e.type == "WorkerPhase" and e.data["slot"] in rollout_slots]
    assert "compiling" in phases  # the vLLM engine's start
    held = sorted({e.data["version"] for e in events if e.type == "WeightsHeld" and e.data["slot"] in rollout_slots})
    assert held == list(range(STEPS)), held  # every version loaded into the running engine, in place
    assert sum(1 for e in events if e.type == "TrajectoryStored") >= STEPS * 4 * 4
    assert not [e for e in events if e.type == "Verdict"], "a vLLM start or reload looked like a fault"
