"""Small reference job specs for tests, benchmarks and simulator calibration (local backend, CPU).

The model is tiny and the phase bounds are sized for it, so a job trains a step a second or so
on two cores and every fault kind is detected within seconds.
"""

from __future__ import annotations

from pathlib import Path


def workload_tables(step_scale: int = 1) -> str:
    """The rollout and workload tables of the small reference job, shared with the lab's job
    (rlctl.lab.jobs). ``step_scale`` multiplies the prompts of a step (and the batches that carry
    them): a step does ``step_scale`` times the work, as real RL steps do far more than this one."""
    if step_scale < 1:
        raise ValueError(f"step_scale must be at least 1, got {step_scale}")
    return f"""[rollout]
batch_prompts = {4 * step_scale}
group_size = 4
max_new_tokens = 48
dataset_size = {128 * step_scale}
worker_batch = {16 * step_scale}

[rollout.tail_batching]
enabled = true
short_max_tokens = 16
overprovision = 0.5
long_batch = {4 * step_scale}

[workload]
model_dim = 64
layers = 2
heads = 1
warmstart_steps = 60
"""


SMALL_WORKLOAD_TABLES = workload_tables(1)

SMALL_JOB = """
[job]
name = "{name}"
steps = {steps}
seed = 1
checkpoint_every = {checkpoint_every}

[cluster]
backend = "local"
agent_tls = "{agent_tls}"
[cluster.local]
nodes = 0
{cluster_gpus_line}
[roles.trainer]
nodes = {trainers}
{gpus_line}[roles.rollout]
nodes = {rollouts}
{rollout_gpus_line}{rollout_placement}[roles.reward]
nodes = 1

[spares]
nodes = {spares}
warm = true
replicate_trainer_state = {replicate}

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
stepping = 8.0
loading = 60.0
checkpointing = 8.0

"""


def gpu_line(gpus_per_node: int) -> str:
    """The template's GPU line (the cluster's and the trainer's and rollout's): none for the default
    of 1 simulated GPU a node (the template's text is then what tests that edit it expect)."""
    return "" if gpus_per_node == 1 else f"gpus_per_node = {gpus_per_node}\n"


def write_job(tmp_path: Path, name: str = "itest", steps: int = 400, rollouts: int = 2, spares: int = 1,
              policy: str = "role", checkpoint_every: int = 3, max_restarts: int = 2, step_scale: int = 1,
              trainers: int = 1, agent_tls: str = "auto", extra_tables: str = "", gpus_per_node: int = 1,
              colocated: bool = False, rollout_gpus_per_node: int = 0, replicate_trainer_state: bool = True) -> Path:
    """The small reference job as a file; ``extra_tables`` (TOML) is appended, e.g. ``[model]``,
    ``[data]`` and ``[reward]`` for a job on a Hugging Face model. ``gpus_per_node`` (simulated):
    a trainer node runs that many ranks, a rollout node that many engines. ``colocated``: the
    engines run on the trainer nodes (``rollouts`` must then equal ``trainers``).
    ``rollout_gpus_per_node``: a rollout node's own count when it differs (0: ``gpus_per_node``)."""
    rollout_gpus = rollout_gpus_per_node or gpus_per_node
    nodes = trainers + (0 if colocated else rollouts) + 1 + spares
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.toml"
    path.write_text(SMALL_JOB.format(name=name, steps=steps, trainers=trainers, rollouts=rollouts, spares=spares, nodes=nodes,
                                     policy=policy, checkpoint_every=checkpoint_every,
                                     replicate=str(replicate_trainer_state).lower(),
                                     max_restarts=max_restarts, agent_tls=agent_tls,
                                     gpus_line=gpu_line(gpus_per_node), rollout_gpus_line=gpu_line(rollout_gpus),
                                     cluster_gpus_line=gpu_line(max(gpus_per_node, rollout_gpus)),
                                     rollout_placement='placement = "colocated"\n' if colocated else "")
                    + workload_tables(step_scale)
                    + extra_tables)
    return path


# Issue 19's pieces switched on together: stream training, reward helpers (idle rollouts and the
# spare score a long queue) and 2-turn episodes against an env worker running ``TURNS_ENV``.
RL_STAGES_TABLES = """
[trainer]
stream = true
[reward]
helper_backlog = 2
[roles.env]
nodes = 1
[env]
class = "turns_env.py:Turns"
max_turns = 2
turn_timeout_s = 2.0
"""
TURNS_ENV = """
class Turns:
    def reset(self, sample):
        self.turns = 0
        return ""

    def step(self, action):
        self.turns += 1
        return "go on", 0.0, self.turns >= 2, {}
"""


def write_rl_stages_env(folder: Path) -> str:
    """``TURNS_ENV`` as ``turns_env.py`` in ``folder`` (beside the job file); returns the job's tables."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "turns_env.py").write_text(TURNS_ENV)
    return RL_STAGES_TABLES


SLOW_REWARD = """import time

from rlctl.workload.rewardfn import task_score


def slow_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return task_score(data_source, solution_str, ground_truth, extra_info)
"""


def slow_reward_table(folder: Path, helper_backlog: int = 0, seconds: float = 0.05) -> str:
    """A ``[reward]`` table whose function sleeps ``seconds`` a sample before the reference task's
    scoring (a sandboxed code run, a remote judge); its file is written into ``folder``."""
    (folder / "slow_reward.py").write_text(SLOW_REWARD.format(seconds=seconds))
    return f'\n[reward]\nfunction = "slow_reward.py:slow_score"\nhelper_backlog = {helper_backlog}\n'
