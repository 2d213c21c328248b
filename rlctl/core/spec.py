"""The job spec (job.toml): its schema, validation and the typed JobSpec it becomes.

``parse_spec`` takes the already-parsed TOML data and the file name (for messages) and either
returns a JobSpec or raises SpecError listing every problem as ``file: key: what was expected``.
Pure: reading the file is the caller's job (see rlctl.assembly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.algorithm import (
    ALGORITHM_FIELDS,
    AlgorithmSpec,
    RecipeContext,
    algorithm_problems,
    legacy_key_problems,
)
from rlctl.core.elastic import EngineCurve
from rlctl.core.reward_health import DEFAULT_MAX_CONSECUTIVE_FAILURES
from rlctl.core.schema import Field, Problem, render_markdown, validate_table

ROLE_NAMES = ("trainer", "rollout", "reward", "env")
PHASES_WITH_BOUNDS = (
    "starting",
    "compiling",
    "loading",
    "regrouping",
    "generating",
    "scoring",
    "stepping",
    "training",
    "weight-sync",
    "checkpointing",
    "waiting-for-work",
    "waiting-for-batch",
)
# A reward call past its timeout is killed and its sandbox restarted before the next sample: the
# scoring phase's progress bound must leave this much beyond the timeout.
REWARD_RESTART_MARGIN_S = 2.0
# The same for an environment call past its turn time limit (the env sandbox restarts and replays).
ENV_RESTART_MARGIN_S = 5.0
ENV_ON_ERROR = ("retry", "score")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class SpecError(ValueError):
    """The job file is invalid. ``problems`` holds every problem found, each naming its key."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(p.render(source) for p in problems))


def _job_name_check(value: str) -> str | None:
    if _JOB_NAME.match(value):
        return None
    return "expected a name of letters, digits, '.', '_' or '-' (at most 63, starting with a letter or digit)"


def _non_empty_list(value: list[str]) -> str | None:
    return None if value else "expected a non-empty list of strings"


def _role_fields(nodes_default: int, command: list[str], minimum_nodes: int, workers: str,
                 extra: dict[str, Field] | None = None) -> dict[str, Field]:
    return {
        "nodes": Field("int", f"Nodes that run this role. {workers}", nodes_default, minimum=minimum_nodes),
        "gpus_per_node": Field("int", "GPUs each node of this role uses (simulated on the local backend).", 1, minimum=0),
        **(extra or {}),
        "command": Field(
            "str-list",
            "Program the role's worker runs (argv). `python` means the controller's interpreter on the local backend "
            "and `[cluster.*].python` elsewhere.",
            command,
            check=_non_empty_list,
        ),
        "env": Field("str-map", "Extra environment variables for the role's workers.", {}),
        "fork_from_template": Field(
            "bool",
            "Fork this role's workers from the host's worker template when `[cluster] worker_template` is on; "
            "false: always start them in a fresh interpreter (a program that must not inherit the template's "
            "imports, or that initialises CUDA before its own imports).",
            True,
        ),
    }


JOB_SCHEMA: dict[str, Field] = {
    "job": Field(
        "table",
        "The job as a whole.",
        fields={
            "name": Field("str", "Job name; the job id is the name plus a timestamp.", required=True, check=_job_name_check),
            "steps": Field("int", "RL steps (optimizer updates) to run; the job succeeds after the last one.", 20, minimum=1),
            "seed": Field("int", "Seed for prompts, sampling and initialisation.", 0, minimum=0),
            "state_dir": Field(
                "str",
                "Where per-job directories (journal, logs, checkpoints) are created. `~` is expanded. "
                "Overridden by `RLCTL_HOME`.",
                "~/.rlctl/jobs",
            ),
            "checkpoint_every": Field("int", "Trainer checkpoint interval in steps.", 5, minimum=1),
            "stop_checkpoint_timeout_s": Field(
                "float",
                "How long `rlctl stop` waits for the trainer to finish the step it is on and checkpoint the "
                "version it holds before it stops it (`rlctl stop --timeout` overrides it; `--now` skips the "
                "checkpoint). On timeout the trainer is stopped anyway and the previous checkpoint stays.",
                300.0,
                minimum=1.0,
            ),
        },
    ),
    "cluster": Field(
        "table",
        "Where the nodes come from.",
        fields={
            "backend": Field("choice", "Which backend allocates nodes.", "local", choices=("local", "ssh", "slurm")),
            "worker_template": Field(
                "bool",
                "Workers fork from a worker template: a process of the job's interpreter that has imported torch, "
                "transformers and the role code (never CUDA), one per job on each host, shared by the job's agents "
                "there (on the local backend, every virtual node). Worker (re)starts fork from it and run role code in "
                "well under a second instead of paying for those imports again; the first start on a host waits for "
                "the template (at most 20 s) instead of importing everything itself. A start that finds no ready "
                "template spawns the worker as before (a dead template is restarted). Only `python -m module ...` and "
                "`python script.py ...` commands fork. Per role: `fork_from_template`.",
                True,
            ),
            "agent_tls": Field(
                "choice",
                "TLS on the agent link, with a per-job self-signed certificate every agent pins. `auto`: on for "
                "ssh and slurm (agents cross a network), off for local (loopback only).",
                "auto",
                choices=("auto", "on", "off"),
            ),
            "local": Field(
                "table",
                "The embedded local backend: virtual nodes that are processes on this machine.",
                fields={
                    "nodes": Field("int", "Virtual nodes the machine may run (roles plus spares must fit; replacements come from the rest). 0: no limit.", 0, minimum=0),
                    "gpus_per_node": Field("int", "Simulated GPUs per virtual node.", 1, minimum=0, maximum=16),
                },
            ),
            "ssh": Field(
                "table",
                "A static inventory of SSH-reachable machines.",
                fields={
                    "hosts": Field("str-list", "Inventory entries `name=address` (address may be `user@host:port`).", []),
                    "spares": Field("str-list", "Names from `hosts` kept as spares.", []),
                    "user": Field("str", "Default SSH user.", "root"),
                    "port": Field("int", "Default SSH port.", 22, minimum=1, maximum=65535),
                    "key_file": Field("str", "Private key used to log in.", "~/.ssh/id_ed25519"),
                    "known_hosts": Field("str", "known_hosts file used to verify host keys.", "~/.ssh/known_hosts"),
                    "insecure_no_host_key_check": Field(
                        "bool", "Skip host-key verification. Test-only; logs a loud warning.", False
                    ),
                    "python": Field("str", "Python interpreter on the nodes.", "python3"),
                    "remote_dir": Field("str", "Directory on the nodes for the agent and its state.", "/tmp/rlctl"),
                    "controller_host": Field("str", "Address the agents use to reach the controller.", "127.0.0.1"),
                    "max_parallel": Field("int", "Concurrent SSH operations.", 32, minimum=1),
                    "connect_timeout_s": Field("float", "Per-host SSH connect timeout.", 10.0, minimum=0.1),
                    "command_timeout_s": Field("float", "Per-host timeout of one remote command.", 60.0, minimum=0.1),
                    "probe_timeout_s": Field("float", "Timeout of the second-path SSH probe.", 5.0, minimum=0.1),
                    "lab_dir": Field("str", "State dir of an `rlctl lab` cluster, for lab-only faults (partition).", ""),
                },
            ),
            "slurm": Field(
                "table",
                "A Slurm cluster reached through sbatch/srun/squeue/scontrol on this machine.",
                fields={
                    "partition": Field("str", "Partition to submit to (empty: the cluster default).", ""),
                    "account": Field("str", "Account to charge (empty: none).", ""),
                    "time_limit": Field("str", "Time limit for every allocation (`--time`).", "01:00:00"),
                    "max_nodes": Field("int", "Nodes the partition has (0: do not check placements).", 0, minimum=0),
                    "exclude": Field("str-list", "Nodes never to use.", []),
                    "allow_drain": Field("bool", "Drain a node rlctl judged bad (needs Slurm operator rights).", False),
                    "python": Field("str", "Python interpreter on the nodes.", "python3"),
                    "controller_host": Field("str", "Address the agents use to reach the controller.", "127.0.0.1"),
                    "extra_sbatch": Field("str-list", "Extra `#SBATCH` options, verbatim (e.g. `--qos=high`).", []),
                    "slurm_conf": Field("str", "Path to slurm.conf when it is not the default (`SLURM_CONF`).", ""),
                    "node_workdir": Field("str", "Agent work directory on each node (`{job_id}` and `{node}` are replaced; empty: /tmp/rlctl/{job_id}/{node}).", ""),
                    "allocate_timeout_s": Field("float", "How long to wait for the allocations to start.", 300.0, minimum=1.0),
                    "replace_timeout_s": Field("float", "How long to wait for a replacement allocation.", 300.0, minimum=1.0),
                    "agent_start_timeout_s": Field("float", "How long to wait for srun to start an agent.", 120.0, minimum=1.0),
                    "probe_timeout_s": Field("float", "Budget of the second-path probe (Slurm's view plus a slurmd connect).", 2.0,
                                             minimum=0.1),
                    "lab_dir": Field("str", "State dir of an `rlctl lab` cluster, for lab-only faults (partition).", ""),
                },
            ),
        },
    ),
    "roles": Field(
        "table",
        "The RL roles. A trainer node runs one rank per GPU, a rollout node one engine per "
        "`tensor_parallel_size` GPUs, a reward or env node one worker.",
        fields={
            "trainer": Field(
                "table",
                "The policy trainer (GRPO).",
                fields=_role_fields(
                    1, ["python", "-m", "rlctl.roles.trainer"], 0,
                    "A node runs one rank per GPU (one process each, `CUDA_VISIBLE_DEVICES` and "
                    "`RANK`/`LOCAL_RANK`/`WORLD_SIZE` set as torchrun would; one rank on a node without GPUs). "
                    "All ranks of all trainer nodes form one group (torch.distributed: gloo on CPU, NCCL on GPU; "
                    "the store on the first trainer's node); a failed rank restarts the whole group."),
            ),
            "rollout": Field(
                "table",
                "Generation workers; they also hold the newest weights and are the trainer's warm standbys.",
                fields=_role_fields(
                    2, ["python", "-m", "rlctl.roles.rollout"], 0,
                    "A node runs `gpus_per_node / tensor_parallel_size` engines (one process each, on its own "
                    "GPUs; one engine on a node without GPUs); each engine is recovered on its own.",
                    {"tensor_parallel_size": Field(
                        "int", "GPUs of one generation engine (vLLM tensor parallelism); must divide gpus_per_node.",
                        1, minimum=1),
                     "placement": Field(
                         "choice", "`disaggregated`: engines on their own nodes. `colocated` (verl's hybrid engine, ROLL's "
                         "colocated device mapping): the engines run on the trainer's nodes and GPUs and take turns with it. "
                         "An engine releases its memory while the trainer steps; the trainer offloads its optimizer state "
                         "while the engines generate; weights reach the engine from the trainer on the same node. Needs "
                         "`nodes` and `gpus_per_node` equal to the trainer's, and no `[trainer] stream`.",
                         "disaggregated", choices=("disaggregated", "colocated"))}),
            ),
            "reward": Field(
                "table",
                "Verifier workers that score completions.",
                fields=_role_fields(1, ["python", "-m", "rlctl.roles.reward"], 0,
                                    "A node runs one verifier worker, with all the node's GPUs."),
            ),
            "env": Field(
                "table",
                "Environment workers for multi-turn agentic RL (`[env]`): rollouts play episodes against them. "
                "0 nodes: single-turn generation.",
                fields=_role_fields(0, ["python", "-m", "rlctl.roles.env"], 0,
                                    "A node runs one environment worker, with all the node's GPUs."),
            ),
        },
    ),
    "spares": Field(
        "table",
        "Spare nodes kept ready to replace failed ones.",
        fields={
            "nodes": Field("int", "Spare nodes allocated with the job.", 1, minimum=0),
            "warm": Field(
                "bool",
                "Run a warm standby on each spare (everything loaded) so any failed role is taken over at once.", True
            ),
            "command": Field(
                "str-list", "Program a warm standby runs.", ["python", "-m", "rlctl.roles.standby"], check=_non_empty_list
            ),
            "fork_from_template": Field(
                "bool",
                "Fork warm standbys from the host's worker template when `[cluster] worker_template` is on.",
                True,
            ),
            "replicate_trainer_state": Field(
                "bool",
                "Warm standbys keep a copy of the trainer's state (weights, optimizer, RNG, step) in memory, "
                "refreshed after every step: one part per rank of a sharded (FSDP) group, each rank's own shards. "
                "A standby that takes over a lone trainer, or a trainer group that restarts (each rank taking its "
                "part back from the standby), resumes at the last step instead of retraining the steps since the "
                "last checkpoint. Not for `sharding = \"ddp\"` groups (every rank's part would be the whole state).",
                True,
            ),
        },
    ),
    "fault_tolerance": Field(
        "table",
        "Detection and recovery.",
        fields={
            "policy": Field(
                "choice",
                "`role` recovers only what failed; `full-restart` is the stop-everything baseline.",
                "role",
                choices=("role", "full-restart"),
            ),
            "heartbeat_interval_s": Field("float", "Agent heartbeat interval.", 1.0, minimum=0.05, maximum=60.0),
            "phi_threshold": Field("float", "φ-accrual suspicion threshold for missing heartbeats.", 8.0, minimum=1.0),
            "min_silence_s": Field(
                "float", "Never suspect a node silent for less than this (acceptable pause).", 2.0, minimum=0.1
            ),
            "confirm_with_probe": Field(
                "bool", "Declare node loss only when the backend's second path (process/SSH/Slurm) also fails.", True
            ),
            "max_restarts_per_slot": Field(
                "int", "Worker restarts on the same node before the node is replaced instead.", 2, minimum=0
            ),
            "max_failed_starts": Field(
                "int", "Workers of one slot that fail in a row before they ever serve (load, restore, hold the "
                "weights), on any node, before the job gives up on that slot and fails with the last one's error: "
                "a worker that can never start (a corrupt model file, a broken environment) must not restart "
                "forever.", 3, minimum=1,
            ),
            "stall_s": Field(
                "float", "A running (or recovering) job that publishes no new version and meets no new fault "
                "for this long has deadlocked (every worker waits, so no detector fires): it fails, naming its "
                "last progress, and the time since its last version counts as lost. 0 turns the guard off. "
                "Keep it above the longest step plus the longest load.", 3600.0, minimum=0.0,
            ),
            "slow_ratio": Field(
                "float", "A node whose throughput is below this fraction of its peers' median is slow.", 0.35, minimum=0.01,
                maximum=1.0,
            ),
            "slow_window_s": Field("float", "How long a node must stay slow before it is a fault.", 10.0, minimum=1.0),
            "exclude_failed_nodes": Field("bool", "Never place work again on a node judged failed.", True),
            "poll_silence_s": Field(
                "float", "A worker waiting by polling the controller (for work, a batch, a role) that stops asking this "
                "long is hung.", 8.0, minimum=1.0,
            ),
            "agent_orphan_timeout_s": Field(
                "float", "An agent that has not reached its controller for this long stops its workers and exits, so a "
                "job whose controller died does not hold its GPUs forever. Long enough that a controller restart or a "
                "brief outage never trips it (`rlctl resume` within this time finds every worker still running).",
                1800.0, minimum=30.0,
            ),
            "phase_timeout_s": Field(
                "table",
                "Per-phase progress bounds: a worker whose progress counter is frozen this long in the phase is hung. "
                "Idle phases (`waiting-*`, `weight-sync`, `checkpointing`, `compiling`, `loading`) get generous "
                "bounds and are never judged by utilisation.",
                fields={
                    phase: Field("float", f"Bound for `{phase}`.", default, minimum=0.5)
                    for phase, default in {
                        "starting": 120.0,
                        "compiling": 900.0,
                        "loading": 600.0,
                        "regrouping": 600.0,
                        "generating": 8.0,
                        "scoring": 8.0,
                        "stepping": 30.0,
                        "training": 30.0,
                        "weight-sync": 120.0,
                        "checkpointing": 300.0,
                        "waiting-for-work": 3600.0,
                        "waiting-for-batch": 3600.0,
                    }.items()
                },
            ),
        },
    ),
    "rollout": Field(
        "table",
        "Rollout scheduling.",
        fields={
            "batch_prompts": Field("int", "Prompts per training batch (each yields `group_size` samples).", 8, minimum=1),
            "group_size": Field("int", "Samples per prompt (GRPO group).", 4, minimum=1),
            "max_new_tokens": Field("int", "Hard cap on response length (long rounds).", 256, minimum=1),
            "dataset_size": Field("int", "Prompts in the generated dataset (one epoch).", 512, minimum=1),
            "worker_batch": Field("int", "Items a rollout worker generates together.", 16, minimum=1),
            "tail_batching": Field(
                "table",
                "RollPacker-style tail batching: short capped rounds, long prompts deferred to long rounds.",
                fields={
                    "enabled": Field("bool", "Off means plain synchronous batching.", True),
                    "short_max_tokens": Field("int", "Response cap in short rounds.", 32, minimum=1),
                    "overprovision": Field(
                        "float", "Extra prompts dispatched in a short round, as a fraction of the batch.", 0.5,
                        minimum=0.0, maximum=4.0,
                    ),
                    "long_batch": Field("int", "Prompts in a long round (0: the same as `batch_prompts`).", 0, minimum=0),
                },
            ),
            "elastic": Field(
                "table",
                "RollPacker's elastic rollout parallelism: for a long round the engines of each rollout node regroup "
                "into fewer engines with more tensor parallelism (faster tokens on the long tail), and go back for "
                "short rounds. Needs tail batching and a rollout node with GPUs for several engines.",
                fields={
                    "enabled": Field("bool", "Let long rounds regroup the engines.", False),
                    "tensor_parallel_size": Field("int", "The engines' degree in a regrouped round (0: twice "
                                                  "`roles.rollout.tensor_parallel_size`).", 0, minimum=0),
                    "policy": Field("choice", "`cost-model`: regroup when the fitted engine curve says the round's "
                                    "time saved exceeds a round trip of reconfiguration. `always`: every long round.",
                                    "cost-model", choices=("cost-model", "always")),
                    "curve": Field("str", "JSON file of measured engine figures (decode-step seconds per degree and "
                                   "batch, and the regroup time): `rlctl model curve` measures one. Needed by the "
                                   "`cost-model` policy.", ""),
                },
            ),
        },
    ),
    "weights": Field(
        "table",
        "Weight synchronisation between holders (point to point; no collective group).",
        fields={
            "transport": Field(
                "choice", "`auto` uses UCX when ucxx imports, else TCP.", "auto", choices=("auto", "ucx", "ucx-sm", "tcp")
            ),
            "host": Field("str", "Address holders listen on and advertise.", "127.0.0.1"),
            "device_memory": Field(
                "choice", "Keep weights versions in GPU memory for pulls device to device over UCX (`cuda_ipc` on "
                "one node, GPUDirect RDMA across nodes): the trainer keeps a copy of the version it serves, rollouts "
                "pull into GPU memory and load from there. `auto`: on CUDA where UCX carries CUDA memory and the "
                "copy fits; `on`: wherever the transport is UCX (on CPU too); `off`: through host memory always.",
                "auto", choices=("auto", "on", "off")),
            "shared_memory": Field(
                "bool", "Joiners on a holder's node copy the version out of the holder's memory (a memory file "
                "handed over a Unix socket, copied and checksummed on several threads) instead of over the "
                "transport. Off: every pull goes over `transport`.", True),
        },
    ),
    "model": Field(
        "table",
        "The policy: a local Hugging Face model folder (config.json, safetensors, tokenizer.json). Empty `path`: "
        "the reference task's small built-in model ([workload] shapes it).",
        fields={
            "path": Field("str", "Hugging Face model folder any `AutoModelForCausalLM` loads (`~` is expanded; "
                          "relative to the job file). `rlctl model init` makes a tiny one.", ""),
            "dtype": Field("choice", "Weights' dtype: `auto` is bfloat16 on GPU and float32 on CPU.", "auto",
                           choices=("auto", "float32", "bfloat16", "float16")),
            "trust_remote_code": Field("bool", "Let transformers run the model folder's own code.", False),
            "gradient_checkpointing": Field("bool", "Recompute activations in the backward pass (less memory).", False),
            "max_prompt_tokens": Field("int", "Prompts longer than this (after the chat template) are left out of "
                                       "the job; the launch says how many.", 1024, minimum=1),
            "max_response_tokens": Field("int", "Response cap; 0 means `rollout.max_new_tokens`.", 0, minimum=0),
        },
    ),
    "data": Field(
        "table",
        "The prompts: parquet or JSON-lines files in verl's layout (or columns named here). No files: the "
        "reference task's generated prompts (`rollout.dataset_size` of them).",
        fields={
            "train_files": Field("str-list", "Training prompt files (.parquet, .jsonl).", []),
            "eval_files": Field("str-list", "Held-out prompt files: one sample per prompt, with the same seed at "
                                "every evaluation, scored by the job's reward function (the held-out reward).", []),
            "eval_every": Field("int", "Evaluate on the held-out prompts every this many weights versions, and the "
                                "final one (0: never).", 10, minimum=0),
            "eval_max_prompts": Field("int", "Held-out prompts per evaluation: the first N in file order (0: all).",
                                      64, minimum=0),
            "prompt_key": Field("str", "Column of the prompt: a chat message list or a string.", "prompt"),
            "ground_truth_key": Field("str", "Column of the ground truth (a dotted key reaches into a struct).",
                                      "reward_model.ground_truth"),
            "data_source_key": Field("str", "Column naming each row's source (`\"\"`: the layout has none).",
                                     "data_source"),
            "extra_info_key": Field("str", "Column of extra information for the reward (`\"\"`: none).", "extra_info"),
            "filter_overlong_prompts": Field(
                "bool", "Leave prompts longer than `model.max_prompt_tokens` (after the chat template) out of the "
                "job; the launch says how many. False: `truncation` decides (verl's default is false).", True),
            "truncation": Field(
                "choice", "With `filter_overlong_prompts = false`, what a prompt longer than "
                "`model.max_prompt_tokens` becomes: `error` refuses the launch naming the rows, `left` keeps its "
                "last tokens, `right` its first, `middle` both ends (verl's `data.truncation`).", "error",
                choices=("error", "left", "right", "middle")),
        },
    ),
    "reward": Field(
        "table",
        "How samples are scored: verl's signature `fn(data_source, solution_str, ground_truth, extra_info) -> "
        "float | dict` (a dict has `score` plus extra metrics; `async def` works too).",
        fields={
            "function": Field("str", "`auto` (by data_source), `gsm8k`, `gsm8k-flexible`, `math`, `task`, `code` (Python run against tests "
                              "with a time and memory limit), "
                              "`package.module:fn` or `path/to/file.py:fn`.", "auto"),
            "path": Field("str", "verl's form: a Python file (relative to the job file) holding `name`.", ""),
            "name": Field("str", "verl's form: the function in `path`.", "compute_score"),
            "timeout_s": Field("float", "Per-sample time limit; a call past it is an error. Must stay below the "
                               "`scoring` phase bound by the sandbox's restart margin, so a hung function never "
                               "looks like a hung worker.", 5.0, minimum=0.1),
            "on_error": Field("choice", "A function that raises or times out: `zero` scores the sample 0 and goes "
                              "on; `fail` stops the job as failed. Either way an event names the function, the "
                              "sample and the error.", "zero", choices=("zero", "fail")),
            "max_consecutive_failures": Field(
                "int", "With `on_error = \"zero\"`: the job fails after this many reward calls in a row raised, "
                "died or timed out, with a message naming the function, the count and the last error (0: never). "
                "The default fails a raising function within a second and a hung one within two minutes at the "
                "default `timeout_s` on one reward worker, yet outlasts a whole group of a prompt the function "
                "cannot score; raise it for groups larger than about 16. Whatever it is, `rlctl status` and the "
                "events say when most recent calls fail, and that time is `lost` in the ETTR ledger.",
                DEFAULT_MAX_CONSECUTIVE_FAILURES, minimum=0),
            "helper_backlog": Field("int", "Reward scheduling: when this many generated samples wait for a score "
                                    "(a slow verifier), idle capacity scores small chunks too, each worker in "
                                    "its own sandbox: rollout workers with nothing to generate (back to "
                                    "generating as soon as a round needs them) and warm standbys on spares "
                                    "(ready to take over a role after the chunk). 0: only the reward workers "
                                    "score.", 0, minimum=0),
        },
    ),
    "env": Field(
        "table",
        "Multi-turn agentic RL (ROLL's environment workers), with `[roles.env] nodes` at least 1. The user's "
        "environment is a class with `reset(sample) -> observation` and `step(action_text) -> (observation, "
        "reward, done, info)`; a rollout plays each sample as an episode: it generates a turn, the environment "
        "answers, the observation joins the context through the chat template, and so on. Only the model's own "
        "tokens are trained.",
        fields={
            "class": Field("str", "`calculator` (a `<calc>` tool for GSM8K-layout math), `package.module:Class` or "
                           "`path/to/file.py:Class` (relative to the job file).", "calculator"),
            "max_turns": Field("int", "Model turns per episode at most.", 4, minimum=1, maximum=64),
            "turn_timeout_s": Field("float", "Time limit of one environment call; a call past it is an error. Must "
                                    "stay below the `stepping` phase bound by the sandbox's restart margin.", 10.0,
                                    minimum=0.1),
            "on_error": Field("choice", "An environment call that raises, times out or kills its process (always "
                              "journaled as `EnvFailed`): `retry` runs it again on an env worker (the episode is "
                              "rebuilt by replaying its actions, which must give back the observations the model was shown) up to "
                              "`retries` times, then ends the episode; `score` ends the episode at once. An ended "
                              "episode is scored as it stands.",
                              "retry", choices=ENV_ON_ERROR),
            "retries": Field("int", "Retries of a failed call with `on_error = \"retry\"`.", 2, minimum=0),
            "reward": Field("choice", "The sample's score: `sum` is the reward function's score plus the "
                            "environment's step rewards; `env` is the step rewards alone.", "sum",
                            choices=("sum", "env")),
            "observation_role": Field("choice", "The chat role observations are shown as.", "user",
                                      choices=("user", "tool")),
        },
    ),
    "workload": Field(
        "table",
        "Settings of the reference GRPO workload, passed to the role programs.",
        fields={
            "model_dim": Field("int", "Hidden size of the reference model (a job without `[model] path`).", 128,
                               minimum=16),
            "layers": Field("int", "Layers of the reference model.", 4, minimum=1),
            "heads": Field("int", "Attention heads of the reference model, head_dim 64 each (the vLLM CPU build's "
                           "constraint): `model_dim / 64` keeps attention as wide as the model.", 2, minimum=1),
            "learning_rate": Field("float", "AdamW learning rate.", 3e-4, minimum=0.0),
            "lr_warmup_steps": Field("int", "Linear learning-rate warmup, in RL steps.", 5, minimum=0),
            "lr_scheduler": Field(
                "choice", "The learning-rate schedule over RL steps: `warmup-constant` ramps to the rate over "
                "`lr_warmup_steps` from `1/warmup` and holds it; `constant` and `cosine` are verl's (`optim."
                "lr_scheduler_type`: the ramp starts from 0; cosine decays to `min_lr_ratio` at the job's last "
                "step over `num_cycles`).", "warmup-constant", choices=("warmup-constant", "constant", "cosine")),
            "min_lr_ratio": Field("float", "The cosine schedule's floor, as a fraction of the rate.", 0.0,
                                  minimum=0.0, maximum=1.0),
            "num_cycles": Field("float", "Cosine waves over the run (0.5: one half-cosine down).", 0.5, minimum=0.0),
            "weight_decay": Field("float", "AdamW weight decay.", 0.0, minimum=0.0),
            "adam_beta1": Field("float", "AdamW β1.", 0.9, minimum=0.0, maximum=1.0),
            "adam_beta2": Field("float", "AdamW β2.", 0.99, minimum=0.0, maximum=1.0),
            "grad_clip": Field("float", "Clip the gradients' global norm to this (0: no clip).", 1.0, minimum=0.0),
            "temperature": Field("float", "Sampling temperature, in a job without `[algorithm]` (which has "
                                 "`algorithm.temperature`).", 1.0, minimum=0.0),
            "kl_coef": Field("float", "k3 KL penalty to the initial policy (0 disables), in a job without "
                             "`[algorithm]` (`algorithm.use_kl_loss` and `kl_loss_coef` there).", 0.0, minimum=0.0),
            "clip_eps": Field("float", "PPO ratio clip ε, in a job without `[algorithm]` (`algorithm.clip_ratio_low`"
                              " and `clip_ratio_high` there).", 0.2, minimum=0.0),
            "micro_batch_tokens": Field("int", "Padded tokens per trainer forward pass: a step's samples are "
                                        "sorted by length and cut into micro-batches whose gradients "
                                        "accumulate (0: the whole batch in one pass).", 4096, minimum=0),
            "warmstart_steps": Field("int", "Supervised warm-start steps of the reference model on the reference "
                                     "task's answers, before RL (0: random init).", 600, minimum=0),
            "device": Field("str", "torch device for trainer and rollouts (`cpu`, `cuda`, `auto`).", "auto"),
            "engine": Field("choice", "Rollout generation engine.", "torch", choices=("torch", "vllm")),
            "sharding": Field("choice", "How a trainer group of several ranks holds the model: `fsdp` shards "
                              "weights, gradients and optimizer state over the ranks (FSDP2; float32 master "
                              "weights, layers computing in `[model] dtype` on GPU); `ddp` keeps a whole copy "
                              "on every rank and all-reduces the gradients.", "fsdp", choices=("fsdp", "ddp")),
        },
    ),
    "algorithm": Field(
        "table",
        "The RL recipe under verl's names and defaults (docs/algorithms.md): the advantage estimator, the policy "
        "loss and its aggregation, the KL terms, mini-batches and epochs, DAPO's dynamic sampling and overlong "
        "shaping, and sampling for rollouts and the held-out evaluation. Without this table the job trains GRPO "
        "with `[workload]` `clip_eps`, `kl_coef` and `temperature`.",
        fields=ALGORITHM_FIELDS,
    ),
    "trainer": Field(
        "table",
        "How the trainer takes a step.",
        fields={
            "stream": Field("bool", "Stream-based training (RollPacker): start a step's forward and backward on "
                            "groups as soon as they are generated and scored, while the round's other groups still "
                            "generate; one optimizer step over exactly the batch synchronous GRPO would train, "
                            "every sample from the current weights.", False),
            "stream_parts": Field("int", "With `stream`: the batch is trained in this many parts of equal group "
                                  "count (the last may be smaller).", 4, minimum=1),
        },
    ),
    "observability": Field(
        "table",
        "Where the job's figures go besides `rlctl status`: a Prometheus endpoint on the controller, and "
        "training curves (one point per step: the trainer's metrics, ETTR and fault markers) in TensorBoard "
        "and Weights & Biases. Each is off unless set. A sink that fails while the job runs is logged once "
        "and never stops or slows the job.",
        fields={
            "prometheus_port": Field("int", "Serve `/metrics` on this port from the job's controller (0: off).", 0,
                                     minimum=0, maximum=65535),
            "prometheus_address": Field("str", "Address the `/metrics` endpoint binds.", "127.0.0.1"),
            "tensorboard_dir": Field("str", "TensorBoard log directory for the curves (`~` is expanded; relative "
                                     "to the job file); the same directory across failovers and `rlctl resume`.",
                                     ""),
            "wandb_project": Field("str", "Weights & Biases project for the curves (needs the `wandb` extra).", ""),
            "wandb_mode": Field("choice", "`online` needs a W&B login (`WANDB_API_KEY` or `wandb login`); "
                                "`offline` writes the run under the job directory for `wandb sync`.", "online",
                                choices=("online", "offline")),
            "wandb_entity": Field("str", "W&B entity (team or user; empty: the login's default).", ""),
        },
    ),
}


@dataclass(frozen=True)
class RoleSpec:
    """One role: how many nodes, GPUs per node, what it runs, and how a node's GPUs split into
    workers (processes)."""

    name: str
    nodes: int
    gpus_per_node: int
    command: tuple[str, ...]
    env: dict[str, str]
    tensor_parallel_size: int = 1
    colocated: bool = False  # its workers run on the trainer's nodes and GPUs (allocates no nodes of its own)
    fork_from_template: bool = True  # with [cluster] worker_template on: its workers fork from the host's template

    @property
    def gpus_per_worker(self) -> int:
        """GPUs one worker holds: one per trainer rank, ``tensor_parallel_size`` per engine, all a
        reward node's; 0 on nodes without GPUs."""
        if self.gpus_per_node == 0:
            return 0
        if self.name == "trainer":
            return 1
        if self.name == "rollout":
            return self.tensor_parallel_size
        return self.gpus_per_node

    @property
    def workers_per_node(self) -> int:
        return self.gpus_per_node // self.gpus_per_worker if self.gpus_per_worker else 1

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node


@dataclass(frozen=True)
class TailBatchingSpec:
    enabled: bool
    short_max_tokens: int
    overprovision: float
    long_batch: int


@dataclass(frozen=True)
class ElasticSpec:
    enabled: bool
    tensor_parallel_size: int  # the long rounds' degree (already resolved: never 0)
    policy: str
    curve: str  # the measured figures' file
    fitted: EngineCurve | None = None  # read and fitted from ``curve`` by the job-file loader


@dataclass(frozen=True)
class RolloutSpec:
    batch_prompts: int
    group_size: int
    max_new_tokens: int
    dataset_size: int
    worker_batch: int
    tail_batching: TailBatchingSpec
    elastic: ElasticSpec = ElasticSpec(False, 0, "cost-model", "")


@dataclass(frozen=True)
class FaultToleranceSpec:
    policy: str
    heartbeat_interval_s: float
    phi_threshold: float
    min_silence_s: float
    confirm_with_probe: bool
    max_restarts_per_slot: int
    max_failed_starts: int
    stall_s: float
    slow_ratio: float
    slow_window_s: float
    exclude_failed_nodes: bool
    poll_silence_s: float
    agent_orphan_timeout_s: float
    phase_timeout_s: dict[str, float]


@dataclass(frozen=True)
class EnvSpec:
    """``[env]``: the environment class, how episodes run and what a failed call costs."""

    class_ref: str = "calculator"
    max_turns: int = 4
    turn_timeout_s: float = 10.0
    on_error: str = "retry"
    retries: int = 2
    reward: str = "sum"
    observation_role: str = "user"

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> EnvSpec:
        """From a validated ``[env]`` table (``class`` is a Python keyword, hence ``class_ref``)."""
        return cls(**{("class_ref" if key == "class" else key): value for key, value in table.items()})

    def to_table(self) -> dict[str, Any]:
        return {("class" if key == "class_ref" else key): value for key, value in self.__dict__.items()}


@dataclass(frozen=True)
class ObservabilitySpec:
    prometheus_port: int
    prometheus_address: str
    tensorboard_dir: str
    wandb_project: str
    wandb_mode: str
    wandb_entity: str

    @property
    def curves(self) -> bool:
        """Any training-curve sink is set."""
        return bool(self.tensorboard_dir or self.wandb_project)


@dataclass(frozen=True)
class JobSpec:
    """A validated job. ``raw`` keeps every value (defaults filled) for the backends and workload."""

    source: str
    name: str
    steps: int
    seed: int
    state_dir: str
    checkpoint_every: int
    stop_checkpoint_timeout_s: float
    backend: str
    roles: dict[str, RoleSpec]
    spare_nodes: int
    warm_spares: bool
    standby_command: tuple[str, ...]
    replicate_trainer_state: bool
    fault_tolerance: FaultToleranceSpec
    rollout: RolloutSpec
    weights_transport: str
    weights_host: str
    weights_device_memory: str
    weights_shared_memory: bool
    agent_tls: str
    observability: ObservabilitySpec
    env: EnvSpec
    raw: dict[str, Any] = field(repr=False)
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)

    @property
    def cluster(self) -> dict[str, Any]:
        """The table of the chosen backend (`[cluster.local]`, `[cluster.ssh]` or `[cluster.slurm]`)."""
        return dict(self.raw["cluster"][self.backend])

    @property
    def workload(self) -> dict[str, Any]:
        return dict(self.raw["workload"])

    @property
    def worker_template(self) -> bool:
        """`[cluster] worker_template`: workers fork from a warm template shared by the job's agents on a host."""
        return bool(self.raw["cluster"]["worker_template"])

    @property
    def standby_fork_from_template(self) -> bool:
        """`[spares] fork_from_template`."""
        return bool(self.raw["spares"]["fork_from_template"])

    @property
    def model(self) -> dict[str, Any]:
        """`[model]`; an empty `path` means the reference task's built-in model."""
        return dict(self.raw["model"])

    @property
    def data(self) -> dict[str, Any]:
        return dict(self.raw["data"])

    @property
    def trainer(self) -> dict[str, Any]:
        """`[trainer]`: stream-based training (``stream``, ``stream_parts``)."""
        return dict(self.raw["trainer"])

    @property
    def reward(self) -> dict[str, Any]:
        return dict(self.raw["reward"])

    @property
    def multi_turn(self) -> bool:
        """Rollouts play episodes against env workers."""
        return self.roles["env"].nodes > 0

    @property
    def hf_model(self) -> bool:
        """The policy is a Hugging Face model folder (`[model] path`)."""
        return bool(self.raw["model"]["path"])

    def trainer_state_replicated(self, ranks: int | None = None) -> bool:
        """Warm standbys keep the trainer's state: asked for, and the trainer is alone or a sharded
        group (a plain data-parallel rank's part would be the whole state). ``ranks``: the group's
        size when it is not the spec's (the simulator's scaled layouts)."""
        alone = (self.roles["trainer"].workers if ranks is None else ranks) == 1
        return self.replicate_trainer_state and (alone or self.workload["sharding"] == "fsdp")

    @property
    def nodes_needed(self) -> int:
        return sum(r.nodes for r in self.roles.values() if not r.colocated) + self.spare_nodes

    @property
    def colocated(self) -> bool:
        """The rollout engines share the trainer's nodes and GPUs (``[roles.rollout] placement``)."""
        return self.roles["rollout"].colocated

    @property
    def long_batch(self) -> int:
        return self.rollout.tail_batching.long_batch or self.rollout.batch_prompts


def parse_spec(data: dict[str, Any], source: str) -> JobSpec:
    """Validate parsed TOML ``data`` from file ``source``; raise SpecError naming every problem."""
    values, problems = validate_table(JOB_SCHEMA, data, "")
    algorithm: AlgorithmSpec | None = None
    if not problems:
        problems = _cross_checks(values)
        if "env" in data and values["roles"]["env"]["nodes"] < 1:
            problems.append(Problem("roles.env.nodes", "expected at least 1 env node for the [env] table, got 0"))
        algorithm, recipe_problems = _algorithm(values, data)
        problems.extend(recipe_problems)
    if problems or algorithm is None:
        raise SpecError(source, problems)
    return _build(values, source, algorithm)


def _algorithm(values: dict[str, Any], data: dict[str, Any]) -> tuple[AlgorithmSpec, list[Problem]]:
    """The job's recipe: ``[algorithm]``, or for a job without one its ``[workload]`` objective keys."""
    if "algorithm" in data:
        algorithm = AlgorithmSpec.from_table(values["algorithm"])
        problems = legacy_key_problems(data.get("workload") or {})
    else:
        algorithm, problems = AlgorithmSpec.from_legacy_workload(values["workload"]), []
    rollout, tail = values["rollout"], values["rollout"]["tail_batching"]
    context = RecipeContext(batch_prompts=rollout["batch_prompts"], long_batch=tail["long_batch"] or rollout["batch_prompts"],
                            group_size=rollout["group_size"],
                            max_response_length=values["model"]["max_response_tokens"] or rollout["max_new_tokens"],
                            stream=values["trainer"]["stream"], tail_batching=tail["enabled"])
    return algorithm, problems + algorithm_problems(algorithm, context)


def _cross_checks(values: dict[str, Any]) -> list[Problem]:
    """Checks that involve several keys: placements, role counts, tail-batching coherence."""
    problems: list[Problem] = []
    roles = values["roles"]
    if roles["trainer"]["nodes"] < 1:
        problems.append(Problem("roles.trainer.nodes", "expected at least 1 trainer node, got 0"))
    if roles["rollout"]["nodes"] < 1:
        problems.append(Problem("roles.rollout.nodes", "expected at least 1 rollout node, got 0"))
    rollout_gpus, tensor_parallel = roles["rollout"]["gpus_per_node"], roles["rollout"]["tensor_parallel_size"]
    if rollout_gpus and rollout_gpus % tensor_parallel:
        problems.append(Problem("roles.rollout.tensor_parallel_size",
                                f"expected a divisor of roles.rollout.gpus_per_node ({rollout_gpus}), got {tensor_parallel}"))
    problems.extend(_colocation_checks(values))
    problems.extend(_elastic_checks(values))
    needed = sum(r["nodes"] for r in roles.values() if r.get("placement") != "colocated") + values["spares"]["nodes"]
    backend = values["cluster"]["backend"]
    cluster = values["cluster"][backend]
    if backend == "local":
        available = cluster["nodes"] or needed
        if available < needed:
            problems.append(
                Problem("cluster.local.nodes", f"roles and spares need {needed} nodes but the cluster has {available}")
            )
        for role, table in roles.items():
            if table["gpus_per_node"] > cluster["gpus_per_node"] and table["nodes"] > 0:
                problems.append(
                    Problem(
                        f"roles.{role}.gpus_per_node",
                        f"asks for {table['gpus_per_node']} GPUs per node but local nodes have {cluster['gpus_per_node']}",
                    )
                )
    elif backend == "ssh":
        problems.extend(_ssh_inventory_checks(cluster, needed))
    elif backend == "slurm" and cluster["max_nodes"] and cluster["max_nodes"] < needed:
        problems.append(
            Problem("cluster.slurm.max_nodes", f"roles and spares need {needed} nodes but the cluster has {cluster['max_nodes']}")
        )
    rollout = values["rollout"]
    tail = rollout["tail_batching"]
    if tail["enabled"] and tail["short_max_tokens"] >= rollout["max_new_tokens"]:
        problems.append(
            Problem(
                "rollout.tail_batching.short_max_tokens",
                f"expected less than rollout.max_new_tokens ({rollout['max_new_tokens']}), got {tail['short_max_tokens']}",
            )
        )
    batch = tail["long_batch"] or rollout["batch_prompts"]
    if rollout["dataset_size"] < max(rollout["batch_prompts"], batch):
        problems.append(
            Problem("rollout.dataset_size", f"expected at least one batch ({max(rollout['batch_prompts'], batch)} prompts)")
        )
    if values["data"]["train_files"] and not values["model"]["path"]:
        problems.append(Problem("model.path", "expected a Hugging Face model folder: [data] train_files need its tokenizer"))
    if values["data"]["eval_files"] and not values["data"]["train_files"]:
        problems.append(Problem("data.eval_files", "expected [data] train_files as well"))
    response_cap = values["model"]["max_response_tokens"] or rollout["max_new_tokens"]
    if tail["enabled"] and values["model"]["max_response_tokens"] and tail["short_max_tokens"] >= response_cap:
        problems.append(Problem("rollout.tail_batching.short_max_tokens",
                                f"expected less than model.max_response_tokens ({response_cap})"))
    scoring_bound = values["fault_tolerance"]["phase_timeout_s"]["scoring"]
    reward_timeout = values["reward"]["timeout_s"]
    if values["model"]["path"] and reward_timeout + REWARD_RESTART_MARGIN_S > scoring_bound:
        problems.append(Problem("reward.timeout_s", f"expected at most {scoring_bound - REWARD_RESTART_MARGIN_S:g} "
                                f"(fault_tolerance.phase_timeout_s.scoring = {scoring_bound:g} minus "
                                f"{REWARD_RESTART_MARGIN_S:g} s to restart the sandbox), got {reward_timeout:g}"))
    env_bound = values["fault_tolerance"]["phase_timeout_s"]["stepping"]
    env_timeout = values["env"]["turn_timeout_s"]
    if roles["env"]["nodes"] and env_timeout + ENV_RESTART_MARGIN_S > env_bound:
        problems.append(Problem("env.turn_timeout_s", f"expected at most {env_bound - ENV_RESTART_MARGIN_S:g} "
                                f"(fault_tolerance.phase_timeout_s.stepping = {env_bound:g} minus "
                                f"{ENV_RESTART_MARGIN_S:g} s to restart the sandbox), got {env_timeout:g}"))
    workload = values["workload"]
    if workload["model_dim"] % workload["heads"]:
        problems.append(Problem("workload.heads", f"expected a divisor of workload.model_dim ({workload['model_dim']})"))
    return problems


def _colocation_checks(values: dict[str, Any]) -> list[Problem]:
    """Colocated engines live on the trainer's nodes and GPUs and take turns with it."""
    roles = values["roles"]
    rollout, trainer = roles["rollout"], roles["trainer"]
    if rollout["placement"] != "colocated":
        return []
    problems = []
    for key in ("nodes", "gpus_per_node"):
        if rollout[key] != trainer[key]:
            problems.append(Problem(f"roles.rollout.{key}", f"expected {trainer[key]} (roles.trainer.{key}): colocated "
                                    f"engines run on the trainer's nodes and GPUs, got {rollout[key]}"))
    if values["trainer"]["stream"]:
        problems.append(Problem("trainer.stream", "expected false with roles.rollout.placement = \"colocated\": a "
                                "streamed step trains while the engines on the same GPUs generate"))
    return problems


def _elastic_checks(values: dict[str, Any]) -> list[Problem]:
    """A regroup needs long rounds, several engines' GPUs on a node and engines of their own."""
    elastic, rollout = values["rollout"]["elastic"], values["roles"]["rollout"]
    if not elastic["enabled"]:
        return []
    base = rollout["tensor_parallel_size"]
    wide = elastic["tensor_parallel_size"] or 2 * base
    problems = []
    if wide <= base or wide % base:
        problems.append(Problem("rollout.elastic.tensor_parallel_size", f"expected a multiple of "
                                f"roles.rollout.tensor_parallel_size ({base}) above it, got {wide}"))
    elif rollout["gpus_per_node"] < wide or rollout["gpus_per_node"] % wide:
        problems.append(Problem("roles.rollout.gpus_per_node", f"expected a multiple of rollout.elastic."
                                f"tensor_parallel_size ({wide}): a node's engines regroup into engines of {wide} GPUs, "
                                f"got {rollout['gpus_per_node']}"))
    if not values["rollout"]["tail_batching"]["enabled"]:
        problems.append(Problem("rollout.elastic.enabled", "expected rollout.tail_batching.enabled = true: only "
                                "long rounds regroup"))
    if rollout["placement"] == "colocated":
        problems.append(Problem("rollout.elastic.enabled", "expected roles.rollout.placement = \"disaggregated\": "
                                "colocated engines share their GPUs with the trainer's ranks"))
    if elastic["policy"] == "cost-model" and not elastic["curve"]:
        problems.append(Problem("rollout.elastic.curve", "expected a file of measured engine figures (`rlctl model "
                                "curve` makes one) for the cost-model policy"))
    return problems


def _ssh_inventory_checks(cluster: dict[str, Any], needed: int) -> list[Problem]:
    problems: list[Problem] = []
    names: list[str] = []
    for index, entry in enumerate(cluster["hosts"]):
        name, sep, address = entry.partition("=")
        if not sep or not name or not address:
            problems.append(Problem(f"cluster.ssh.hosts[{index}]", f"expected 'name=address', got {entry!r}"))
        names.append(name)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(Problem("cluster.ssh.hosts", f"duplicate node names: {', '.join(duplicates)}"))
    for spare in cluster["spares"]:
        if spare not in names:
            problems.append(Problem("cluster.ssh.spares", f"{spare!r} is not a name in cluster.ssh.hosts"))
    if len(names) < needed:
        problems.append(Problem("cluster.ssh.hosts", f"roles and spares need {needed} hosts but the inventory has {len(names)}"))
    return problems


def _build(values: dict[str, Any], source: str, algorithm: AlgorithmSpec) -> JobSpec:
    roles = {
        name: RoleSpec(
            name=name,
            nodes=table["nodes"],
            gpus_per_node=table["gpus_per_node"],
            command=tuple(table["command"]),
            env=dict(table["env"]),
            tensor_parallel_size=int(table.get("tensor_parallel_size", 1)),
            colocated=table.get("placement") == "colocated",
            fork_from_template=bool(table["fork_from_template"]),
        )
        for name, table in values["roles"].items()
    }
    ft = values["fault_tolerance"]
    rollout = values["rollout"]
    return JobSpec(
        source=source,
        name=values["job"]["name"],
        steps=values["job"]["steps"],
        seed=values["job"]["seed"],
        state_dir=values["job"]["state_dir"],
        checkpoint_every=values["job"]["checkpoint_every"],
        stop_checkpoint_timeout_s=float(values["job"]["stop_checkpoint_timeout_s"]),
        backend=values["cluster"]["backend"],
        roles=roles,
        spare_nodes=values["spares"]["nodes"],
        warm_spares=values["spares"]["warm"],
        standby_command=tuple(values["spares"]["command"]),
        replicate_trainer_state=values["spares"]["replicate_trainer_state"],
        fault_tolerance=FaultToleranceSpec(**{**ft, "phase_timeout_s": dict(ft["phase_timeout_s"])}),
        rollout=RolloutSpec(
            **{k: v for k, v in rollout.items() if k not in ("tail_batching", "max_new_tokens", "elastic")},
            max_new_tokens=values["model"]["max_response_tokens"] or rollout["max_new_tokens"],
            tail_batching=TailBatchingSpec(**rollout["tail_batching"]),
            elastic=ElasticSpec(**{**rollout["elastic"], "tensor_parallel_size": rollout["elastic"]["tensor_parallel_size"]
                                   or 2 * values["roles"]["rollout"]["tensor_parallel_size"]}),
        ),
        weights_transport=values["weights"]["transport"],
        weights_host=values["weights"]["host"],
        weights_device_memory=values["weights"]["device_memory"],
        weights_shared_memory=values["weights"]["shared_memory"],
        agent_tls=values["cluster"]["agent_tls"],
        observability=ObservabilitySpec(**values["observability"]),
        env=EnvSpec.from_table(values["env"]),
        raw=values,
        algorithm=algorithm,
    )


def spec_reference_markdown() -> str:
    """docs/job-spec.md: every key, its type, default and meaning."""
    header = [
        "# job.toml reference",
        "",
        "Generated from `rlctl/core/spec.py` (`rlctl spec-doc > docs/job-spec.md`). Unknown keys, wrong types and",
        "impossible placements are errors that name the file and the key; nothing starts.",
        "",
    ]
    return "\n".join(header + render_markdown(JOB_SCHEMA)) + "\n"
