"""What a verl run is, in the terms rlctl's job file needs: steps, schedule, recipe, roles, reward.

Role: ``Run`` reads a resolved ``VerlConfig`` (and, through ``Facts``, the train files' row counts
and the model folder's config.json) and derives each value the job file carries, exactly as verl
0.9.1 computes it: the step count from ``trainer.total_training_steps`` or the epochs over the
train files (the last partial batch dropped), the warmup from ``lr_warmup_steps`` or its ratio of
the steps, the loss aggregation from ``loss_agg_mode`` or DAPO's older ``use_token_level_loss``,
the overlong buffer from any of its three spellings. A value rlctl cannot carry exactly raises
``Refusal`` naming the verl key and why. Pure apart from what ``Facts`` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from rlctl.convert.verl_config import MISSING, VerlConfig
from rlctl.core.algorithm import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.model"
OPTIM = f"{A}.optim"
LOCAL_GPUS_MAX = 16  # [cluster.local] gpus_per_node's maximum
_JOB_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}
_ENGINES = {"vllm": "vllm", "hf": "torch"}
REWARD_MANAGERS = ("naive", "dapo")
OVERLONG_SPELLINGS = ("reward_model.overlong_buffer", "custom_reward_function.overlong_buffer",
                      "reward_model.reward_kwargs.overlong_buffer_cfg", "reward.reward_kwargs.overlong_buffer_cfg")
_ESTIMATOR_WHY = {
    "gae": "needs a critic (a value model trained beside the policy), a role rlctl does not have yet",
    "remax": "needs a greedy baseline rollout per prompt, which rlctl does not generate",
}


class Refusal(Exception):
    """The run sets ``key`` to something rlctl cannot carry exactly; ``reason`` says why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


class FactError(Exception):
    """A file the conversion needs cannot be read (the message says which and why)."""


class Facts(Protocol):
    """What the conversion reads beside the overrides."""

    def row_count(self, path: str) -> int:
        """Rows of a parquet or JSON-lines file; raises FactError."""
        ...

    def model_config(self, path: str) -> dict[str, Any]:
        """The model folder's config.json; raises FactError."""
        ...


@dataclass(frozen=True)
class ConvertOptions:
    backend: str = "local"
    placement: str = "colocated"
    cwd: Path = Path(".")  # verl reads relative paths from the directory it runs in


def absolute(path: str, cwd: Path) -> str:
    """``path`` as the job file must name it: ``~`` expanded, relative to where verl ran."""
    if "://" in path:
        return path
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else (cwd / expanded).resolve())


def file_list(value: Any, key: str) -> list[str]:
    """verl's ``data.*_files``: one path or a list of them."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise Refusal(key, f"expected a file or a list of files, got {value!r}")


class Run:
    """A resolved verl config read as rlctl needs it; every property raises Refusal for a value
    rlctl cannot carry, naming the verl key."""

    def __init__(self, cfg: VerlConfig, facts: Facts, options: ConvertOptions) -> None:
        self.cfg, self.facts, self.options = cfg, facts, options
        self.notes: list[str] = []  # choices the conversion made that no override states

    # -- typed reads ------------------------------------------------------------------------------

    def read_int(self, key: str, minimum: int | None = None) -> int:
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise Refusal(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise Refusal(key, f"expected at least {minimum}, got {value}")
        return value

    def read_float(self, key: str) -> float:
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Refusal(key, f"expected a number, got {value!r}")
        return float(value)

    def read_bool(self, key: str) -> bool:
        value = self.cfg[key]
        if not isinstance(value, bool):
            raise Refusal(key, f"expected true or false, got {value!r}")
        return value

    def read_str(self, key: str) -> str:
        value = self.cfg[key]
        if not isinstance(value, str) or value == MISSING:
            raise Refusal(key, "verl requires a value (it has no default)" if value == MISSING
                          else f"expected a string, got {value!r}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], why: str = "") -> str:
        value = self.read_str(key)
        if value not in choices:
            raise Refusal(key, why or f"{value!r} is not one of rlctl's: {', '.join(choices)}")
        return value

    # -- the job --------------------------------------------------------------------------------

    @cached_property
    def job_name(self) -> str:
        raw = self.cfg["trainer.experiment_name"]
        name = _JOB_NAME_CHARS.sub("-", str(raw if raw is not None else "")).strip("-._")[:63].rstrip("-._")
        return name or "verl-run"

    @cached_property
    def seed(self) -> int:
        """job.seed: data.seed (null: 0), for shuffled prompts (rlctl always shuffles them)."""
        if not self.read_bool("data.shuffle"):
            raise Refusal("data.shuffle", "false trains the files in their order; rlctl shuffles every epoch's "
                          "prompts (from job.seed)")
        return 0 if self.cfg["data.seed"] is None else self.read_int("data.seed", 0)

    @cached_property
    def batch_prompts(self) -> int:
        return self.read_int("data.train_batch_size", 1)

    @cached_property
    def steps_per_epoch(self) -> int:
        """verl's ``len(train_dataset) // train_batch_size``; raises for an unknowable dataset size."""
        key = "trainer.total_epochs"
        if self.cfg["data.filter_overlong_prompts"] is True:
            raise Refusal(key, "verl counts an epoch's steps after leaving out the prompts longer than "
                          "data.max_prompt_length, which needs the tokenizer: set trainer.total_training_steps")
        if self.read_int("data.train_max_samples") > 0:
            raise Refusal("data.train_max_samples", "rlctl trains every row of the train files")
        rows = 0
        for path in self.train_files:
            try:
                rows += self.facts.row_count(path)
            except FactError as exc:
                raise Refusal(key, f"the step count is epochs x (rows // data.train_batch_size) and {exc}: set "
                              "trainer.total_training_steps") from None
        return rows // self.batch_prompts

    @cached_property
    def train_rows_note(self) -> str:
        return f"{self.steps_per_epoch} full batches of {self.batch_prompts} an epoch"

    @cached_property
    def steps(self) -> int:
        """verl's total_training_steps: given, or epochs x full batches an epoch."""
        epochs = self.read_int("trainer.total_epochs", 1)
        if self.cfg["trainer.total_training_steps"] is not None:
            steps = self.read_int("trainer.total_training_steps", 1)
            try:
                per_epoch = self.steps_per_epoch
            except Refusal:
                return steps  # the epochs cannot be counted here; verl stops at the given steps
            if epochs * per_epoch < steps:
                raise Refusal("trainer.total_epochs", f"{epochs} epochs of {per_epoch} steps end before "
                              f"trainer.total_training_steps ({steps}): verl stops there with its schedule "
                              "set for the longer run")
            return steps
        steps = epochs * self.steps_per_epoch
        if steps < 1:
            raise Refusal("trainer.total_epochs", f"the train files hold no full batch of "
                          f"{self.batch_prompts} prompts")
        return steps

    @cached_property
    def checkpoint_every(self) -> int:
        every = self.read_int("trainer.save_freq")
        return every if every > 0 else self.steps

    @cached_property
    def eval_every(self) -> int:
        every = self.read_int("trainer.test_freq")
        return max(0, every)

    @cached_property
    def eval_max_prompts(self) -> int:
        limit = self.read_int("data.val_max_samples")
        return max(0, limit)

    # -- hardware ---------------------------------------------------------------------------------

    @cached_property
    def nodes(self) -> int:
        return self.read_int("trainer.nnodes", 1)

    @cached_property
    def gpus_per_node(self) -> int:
        gpus = self.read_int("trainer.n_gpus_per_node", 1)
        if self.options.backend == "local" and gpus > LOCAL_GPUS_MAX:
            raise Refusal("trainer.n_gpus_per_node", f"the local backend simulates at most {LOCAL_GPUS_MAX} GPUs "
                          "a node")
        return gpus

    @cached_property
    def tensor_parallel(self) -> int:
        key = f"{R}.tensor_model_parallel_size"
        size = self.read_int(key, 1)
        if self.gpus_per_node % size:
            raise Refusal(key, f"expected a divisor of trainer.n_gpus_per_node ({self.gpus_per_node}): an engine's "
                          "GPUs are on one node")
        return size

    @cached_property
    def placement(self) -> str:
        if not self.read_bool("actor_rollout_ref.hybrid_engine"):
            raise Refusal("actor_rollout_ref.hybrid_engine", "verl 0.9's trainer runs only the hybrid engine (its "
                          "rollouts on the trainer's GPUs)")
        return "colocated"

    @cached_property
    def device(self) -> str:
        if self.cfg["trainer.device"] != "cuda":
            raise Refusal("trainer.device", f"{self.cfg['trainer.device']!r}: rlctl trains on NVIDIA GPUs (cuda) only")
        return "cuda"

    @cached_property
    def engine(self) -> str:
        if self.cfg[f"{R}.name"] == MISSING:
            self.notes.append(f"{R}.name is not set (verl 0.9 requires it): vLLM, verl's default before 0.9 and "
                              "DAPO's recipe's; the engine changes how fast samples come, not their distribution")
            return "vllm"
        name = self.read_str(f"{R}.name")
        if name not in _ENGINES:
            raise Refusal(f"{R}.name", f"{name!r}: rlctl's engines are vLLM (vllm) and torch (hf)")
        return _ENGINES[name]

    @cached_property
    def sharding(self) -> str:
        strategy = self.read_str(f"{A}.strategy")
        if strategy not in ("fsdp", "fsdp2"):
            raise Refusal(f"{A}.strategy", f"{strategy!r}: rlctl trains with FSDP (fsdp, fsdp2); Megatron's "
                          "tensor and pipeline parallelism are not carried")
        return "fsdp"

    @cached_property
    def dtype(self) -> str:
        key = f"{A}.fsdp_config.dtype"
        dtype = _DTYPES.get(str(self.cfg[key]))
        if dtype is None:
            raise Refusal(key, f"{self.cfg[key]!r} is not a dtype rlctl computes in (bfloat16, float16, float32)")
        master = _DTYPES.get(str(self.cfg[f"{A}.fsdp_config.model_dtype"]))
        if master != "float32":
            raise Refusal(f"{A}.fsdp_config.model_dtype", "rlctl keeps float32 master weights")
        rollout = _DTYPES.get(str(self.cfg[f"{R}.dtype"]))
        if rollout != dtype:
            raise Refusal(f"{R}.dtype", f"the engines generate in [model] dtype, the trainer's ({dtype})")
        return dtype

    # -- the optimizer ------------------------------------------------------------------------------

    @cached_property
    def betas(self) -> tuple[float, float]:
        """AdamW's betas, of torch's AdamW with no extra arguments (rlctl's optimizer)."""
        if str(self.cfg[f"{OPTIM}.optimizer"]).lower() != "adamw":
            raise Refusal(f"{OPTIM}.optimizer", "rlctl's optimizer is torch's AdamW")
        if self.cfg[f"{OPTIM}.optimizer_impl"] != "torch.optim":
            raise Refusal(f"{OPTIM}.optimizer_impl", "rlctl's optimizer is torch.optim.AdamW")
        if self.cfg[f"{OPTIM}.override_optimizer_config"] not in (None, {}):
            raise Refusal(f"{OPTIM}.override_optimizer_config", "extra optimizer arguments rlctl does not pass")
        key = f"{OPTIM}.betas"
        value = self.cfg[key]
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(b, int | float) for b in value)):
            raise Refusal(key, f"expected [beta1, beta2], got {value!r}")
        return float(value[0]), float(value[1])

    @cached_property
    def lr_scheduler(self) -> str:
        style = self.cfg[f"{OPTIM}.warmup_style"]
        key = f"{OPTIM}.warmup_style" if style is not None else f"{OPTIM}.lr_scheduler_type"
        kind = self.choice(key, ("constant", "cosine"), "verl's FSDP schedules are constant and cosine")
        if self.cfg[f"{OPTIM}.zero_indexed_step"] is not True:
            raise Refusal(f"{OPTIM}.zero_indexed_step", "rlctl's schedules count steps from 0, as verl's default")
        return kind

    @cached_property
    def warmup_steps(self) -> int:
        """verl: ``lr_warmup_steps`` when above 0, else ``int(lr_warmup_steps_ratio * total steps)``."""
        steps = self.cfg[f"{OPTIM}.lr_warmup_steps"]
        if steps is not None and self.read_int(f"{OPTIM}.lr_warmup_steps") > 0:
            return int(steps)
        return int(self.read_float(f"{OPTIM}.lr_warmup_steps_ratio") * self.steps)

    @cached_property
    def min_lr_ratio(self) -> float:
        return 0.0 if self.cfg[f"{OPTIM}.min_lr_ratio"] is None else self.read_float(f"{OPTIM}.min_lr_ratio")

    @cached_property
    def grad_clip(self) -> float:
        """verl 0.9's engine clips to ``optim.clip_grad`` (``optim.grad_clip`` is its deprecated
        spelling); older releases read ``actor.grad_clip``, which DAPO's scripts set."""
        spellings = [f"{OPTIM}.grad_clip", f"{OPTIM}.clip_grad", f"{A}.grad_clip"]
        given = [key for key in spellings if self.cfg.is_set(key) and self.cfg[key] is not None]
        if self.cfg[f"{OPTIM}.grad_clip"] is not None and f"{OPTIM}.grad_clip" not in given:
            given.insert(0, f"{OPTIM}.grad_clip")
        chosen = given[0] if given else f"{OPTIM}.clip_grad"
        value = self.read_float(chosen)
        for other in given[1:]:
            if self.read_float(other) != value:
                raise Refusal(other, f"conflicts with {chosen} ({value:g}): which clip applies depends on the verl "
                              "release")
        return value

    # -- the recipe --------------------------------------------------------------------------------

    @cached_property
    def adv_estimator(self) -> str:
        key = "algorithm.adv_estimator"
        value = self.read_str(key)
        if value not in ADV_ESTIMATORS:
            why = _ESTIMATOR_WHY.get(value, f"not one of rlctl's estimators ({', '.join(ADV_ESTIMATORS)})")
            raise Refusal(key, f"{value}: {why}")
        return value

    @cached_property
    def policy_loss(self) -> str:
        return self.choice(f"{A}.policy_loss.loss_mode", POLICY_LOSSES,
                           f"rlctl's policy losses are {', '.join(POLICY_LOSSES)}")

    @cached_property
    def loss_agg_mode(self) -> str:
        mode = self.choice(f"{A}.loss_agg_mode", LOSS_AGG_MODES)
        token_level = self.cfg[f"{A}.use_token_level_loss"]
        if token_level is None:
            return mode
        if not isinstance(token_level, bool):
            raise Refusal(f"{A}.use_token_level_loss", f"expected true or false, got {token_level!r}")
        implied = "token-mean" if token_level else "seq-mean-token-mean"
        if self.cfg.is_set(f"{A}.loss_agg_mode") and mode != implied:
            raise Refusal(f"{A}.use_token_level_loss", f"means loss_agg_mode {implied}, which conflicts with "
                          f"{A}.loss_agg_mode ({mode})")
        return implied

    @cached_property
    def loss_scale_factor(self) -> int:
        key = f"{A}.loss_scale_factor"
        return 0 if self.cfg[key] is None else self.read_int(key, 1)

    @cached_property
    def kl_coef(self) -> float:
        if self.cfg["algorithm.kl_ctrl.type"] != "fixed":
            raise Refusal("algorithm.kl_ctrl.type", "an adaptive controller changes the in-reward KL's weight as the "
                          "run goes; rlctl's is fixed")
        return self.read_float("algorithm.kl_ctrl.kl_coef")

    def kl_type(self, key: str) -> str:
        return self.choice(key, KL_PENALTIES)

    @cached_property
    def rollout_sampling(self) -> tuple[float, float, int]:
        if self.cfg[f"{R}.do_sample"] is not True:
            raise Refusal(f"{R}.do_sample", "greedy training rollouts: rlctl samples them (temperature, top_p, "
                          "top_k)")
        return self.read_float(f"{R}.temperature"), self.read_float(f"{R}.top_p"), self.read_int(f"{R}.top_k")

    @cached_property
    def mini_batch(self) -> int:
        return self.read_int(f"{A}.ppo_mini_batch_size", 1)

    # -- the reward ---------------------------------------------------------------------------------

    @cached_property
    def reward_manager(self) -> str:
        legacy = self.cfg["reward_model.reward_manager"]
        key = "reward_model.reward_manager" if legacy is not None else "reward.reward_manager.name"
        if self.cfg["reward.reward_manager.source"] != "register":
            raise Refusal("reward.reward_manager.source", "a reward manager of your own; rlctl scores as verl's naive "
                          "and dapo managers do")
        return self.choice(key, REWARD_MANAGERS, "rlctl scores as verl's naive and dapo managers do (the "
                           "function's score, DAPO's overlong shaping)")

    @cached_property
    def reward_function(self) -> tuple[str, str] | None:
        """(path, name) of the custom reward function, None for verl's default (by data_source)."""
        legacy = self.cfg.under("custom_reward_function")
        uses_legacy = any(legacy.get(f"custom_reward_function.{k}") is not None for k in ("path", "name"))
        prefix = "custom_reward_function" if uses_legacy else "reward.custom_reward_function"
        path = self.cfg[f"{prefix}.path"]
        if path is None:
            return None
        name = self.cfg[f"{prefix}.name"] or "compute_score"
        kwargs = self.cfg.get(f"{prefix}.reward_kwargs")
        if kwargs not in (None, {}):
            raise Refusal(f"{prefix}.reward_kwargs", "rlctl calls the function with verl's four arguments only")
        return absolute(self.read_str(f"{prefix}.path"), self.options.cwd), str(name)

    @cached_property
    def overlong(self) -> tuple[bool, int, float]:
        """(enable, len, penalty_factor): DAPO's recipe spelling, the older one and verl 0.9's."""
        chosen: dict[str, tuple[str, Any]] = {}
        for field_name in ("enable", "len", "penalty_factor"):
            for spelling in OVERLONG_SPELLINGS:
                key = f"{spelling}.{field_name}"
                if not self.cfg.is_set(key):
                    continue
                if field_name in chosen and chosen[field_name][1] != self.cfg[key]:
                    raise Refusal(key, f"conflicts with {chosen[field_name][0]} ({chosen[field_name][1]!r})")
                chosen.setdefault(field_name, (key, self.cfg[key]))
        enable_key, enable = chosen.get("enable", ("reward_model.overlong_buffer.enable", False))
        if not isinstance(enable, bool):
            raise Refusal(enable_key, f"expected true or false, got {enable!r}")
        length_key, length = chosen.get("len", ("reward_model.overlong_buffer.len", 0))
        penalty_key, penalty = chosen.get("penalty_factor", ("reward_model.overlong_buffer.penalty_factor", 0.0))
        if isinstance(length, bool) or not isinstance(length, int):
            raise Refusal(length_key, f"expected an integer, got {length!r}")
        if isinstance(penalty, bool) or not isinstance(penalty, int | float):
            raise Refusal(penalty_key, f"expected a number, got {penalty!r}")
        if enable and self.reward_manager != "dapo":
            raise Refusal(enable_key, "verl shapes overlong responses only in the dapo reward manager: set "
                          "reward_model.reward_manager=dapo (with it off nothing is shaped)")
        if enable:
            self._check_max_resp_len(enable_key)
        return enable, length, float(penalty)

    def _check_max_resp_len(self, enable_key: str) -> None:
        response_cap = self.read_int("data.max_response_length", 1)
        for spelling in ("reward_model.reward_kwargs", "reward.reward_kwargs"):
            key = f"{spelling}.max_resp_len"
            value = self.cfg[key]
            if value is None and enable_key.startswith(spelling):
                raise Refusal(key, "verl's dapo manager needs it with overlong_buffer_cfg.enable")
            if value is not None and value != response_cap:
                raise Refusal(key, f"{value!r} differs from data.max_response_length ({response_cap}): rlctl "
                              "measures the buffer against the job's response cap")

    # -- files --------------------------------------------------------------------------------

    @cached_property
    def train_files(self) -> list[str]:
        return [absolute(p, self.options.cwd) for p in file_list(self.cfg["data.train_files"], "data.train_files")]

    @cached_property
    def eval_files(self) -> list[str]:
        value = self.cfg["data.val_files"]
        if value in (None, [], ""):
            return []
        return [absolute(p, self.options.cwd) for p in file_list(value, "data.val_files")]

    @cached_property
    def model_path(self) -> str:
        return absolute(self.read_str(f"{M}.path"), self.options.cwd)

    def model_config(self) -> dict[str, Any]:
        return self.facts.model_config(self.model_path)
