"""Small reference job specs for tests, benchmarks and simulator calibration (local backend, CPU).

The model is tiny and the phase bounds are sized for it, so a job trains a step a second or so
on two cores and every fault kind is detected within seconds.
"""

from __future__ import annotations

from pathlib import Path

# The rollout and workload tables of the small reference job, shared with the lab's job (rlctl.lab.jobs).
SMALL_WORKLOAD_TABLES = """[rollout]
batch_prompts = 4
group_size = 4
max_new_tokens = 48
dataset_size = 128
worker_batch = 16

[rollout.tail_batching]
enabled = true
short_max_tokens = 16
overprovision = 0.5
long_batch = 4

[workload]
model_dim = 64
layers = 2
heads = 2
warmstart_steps = 60
"""

SMALL_JOB = """
[job]
name = "{name}"
steps = {steps}
seed = 1
checkpoint_every = {checkpoint_every}

[cluster]
backend = "local"
[cluster.local]
nodes = 0

[roles.trainer]
nodes = 1
[roles.rollout]
nodes = {rollouts}
[roles.reward]
nodes = 1

[spares]
nodes = {spares}
warm = true

[fault_tolerance]
policy = "{policy}"
heartbeat_interval_s = 0.5
min_silence_s = 1.5
max_restarts_per_slot = {max_restarts}
poll_silence_s = 4.0

[fault_tolerance.phase_timeout_s]
generating = 6.0
training = 8.0
weight-sync = 8.0
scoring = 6.0
loading = 60.0

""" + SMALL_WORKLOAD_TABLES


def write_job(tmp_path: Path, name: str = "itest", steps: int = 400, rollouts: int = 2, spares: int = 1,
              policy: str = "role", checkpoint_every: int = 3, max_restarts: int = 2) -> Path:
    nodes = 1 + rollouts + 1 + spares
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.toml"
    path.write_text(SMALL_JOB.format(name=name, steps=steps, rollouts=rollouts, spares=spares, nodes=nodes,
                                     policy=policy, checkpoint_every=checkpoint_every,
                                     max_restarts=max_restarts))
    return path
