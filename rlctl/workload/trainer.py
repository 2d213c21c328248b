"""The RL trainer: the user's recipe (verl's names), atomic checkpoints, optional data parallelism.

Role: the trainer role's compute. ``Trainer.train_step(samples)`` turns one batch of scored
samples (all samples of every prompt group of an RL step) into one RL step, so weights version
``v`` is the model after ``v`` steps (docs/architecture.md, data ops).

Contract:
- The objective is the recipe in ``TrainerConfig.algorithm`` (``rlctl.core.algorithm``), computed
  by ``rlctl.workload.algorithms`` alone (docs/algorithms.md): the estimator's advantages over the
  whole batch, then ``ppo_epochs`` passes of ``ppo_mini_batch_size``-prompt optimizer updates, old
  log-probs taken once before the first update when there are several (so the ratio and the clip
  act from the second on; a single update takes them from its own forward), the policy loss with
  an entropy bonus and a KL loss to a frozen copy of the initial weights, each aggregated by
  ``loss_agg_mode`` over the update's whole mini-batch. The learning-rate schedule steps once per
  RL step, as verl's does.
- The model is a Hugging Face causal LM (``HFPolicy``): weights keep their HF names everywhere.
- ``save_checkpoint`` writes an HF folder atomically (staged beside the target, then renamed):
  the model as ``save_pretrained`` writes it, the tokenizer files, and ``trainer_state.pt`` with
  optimizer, scheduler, reference model, step and the python/torch/numpy RNG states.
  ``load_checkpoint`` followed by ``train_step`` on the retained batches reproduces the
  uninterrupted run's weights exactly (same process layout, same device). ``state_bytes`` /
  ``load_state_bytes`` are the same payload in memory; ``rlctl.workload.rank_state`` holds one
  rank's part of it, for the replica a warm standby keeps.
- A group when ``WORLD_SIZE`` > 1 (env, ``torch.distributed``: gloo on CPU, nccl on CUDA): every
  rank receives the *whole* batch, computes the same advantages, trains on its share (every
  ``world_size``-th sample of each mini-batch) after dividing its loss by the update's global
  token or sequence count, and the gradients are summed, so the update equals the single-process
  one on the whole mini-batch. ``sharding``:
  ``fsdp`` (default) shards weights, gradients and optimizer state over the ranks with FSDP2
  (``rlctl.workload.fsdp``; every rank runs as many micro-batches as the busiest one, so their
  collectives pair up); ``ddp`` keeps a whole copy on every rank and all-reduces the gradients.
  Publishing and checkpointing are then collectives every rank enters (``state_dict_for_publish``,
  ``save_checkpoint``); rank 0 gets the full weights and writes the folder, and with ``fsdp``
  every rank writes its optimizer shard (``torch.distributed.checkpoint``) into it.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.core.checkpoint_names import retired_name, staged_name
from rlctl.workload import algorithms as algos
from rlctl.workload.algorithms import entropy_from_logits
from rlctl.workload.checkpoint_manifest import (
    CheckpointCorruptError,
    CheckpointWriteError,
    verify_checkpoint,
    write_manifest,
)
from rlctl.workload.fsdp import (
    SHARDINGS,
    full_state_dict,
    load_full_state_dict,
    load_optimizer,
    local_shards,
    save_optimizer,
    shard_model,
    total_norm,
)
from rlctl.workload.policy_update import (
    METRIC_FIELDS,
    Denominators,
    ResponseRows,
    TrainSample,
    batch_advantages,
    denominators_of,
    micro_batch_loss,
    mini_batch_plan,
    padded,
    response_logits,
    response_mask_of,
    response_rows,
    token_log_probs,
)

CHECKPOINT_FORMAT = "rlctl-trainer-ckpt-v1"
OPTIMIZER_SHARDS_DIR = "optimizer-shards"  # a sharded group's optimizer state (torch.distributed.checkpoint)
# An HF-format checkpoint is a folder: the model as ``save_pretrained`` writes it (plus the
# tokenizer files), and this file beside it with the optimizer, schedule, RNG and step.
TRAINER_STATE_FILE = "trainer_state.pt"
DEFAULT_PG_TIMEOUT_S = 600.0


LR_SCHEDULERS = ("warmup-constant", "constant", "cosine")


@dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, schedule and objective settings. ``algorithm`` is the recipe (verl's names);
    ``lr_scheduler``: ``warmup-constant`` is rlctl's ``WarmupCosine`` (a cosine only when
    ``total_steps`` > 0), ``constant`` and ``cosine`` are verl's (``VerlSchedule``)."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 0  # 0: constant after warmup
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0  # 0: no clip
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    # Padded tokens per forward pass: the batch is cut into length-sorted micro-batches whose
    # gradients accumulate, so one long sample does not pad every row (0: the whole batch at once).
    micro_batch_tokens: int = 4096
    sharding: str = "fsdp"  # of a group of ranks: fsdp (FSDP2) or ddp (whole copies, all-reduce)
    lr_scheduler: str = "warmup-constant"
    num_cycles: float = 0.5
    max_response_length: int = 0  # the job's response cap: seq-mean-token-sum-norm's divisor (0: the longest seen)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lr_multiplier(self) -> WarmupCosine | VerlSchedule:
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler: expected one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.lr_scheduler == "warmup-constant":
            return WarmupCosine(self.warmup_steps, self.total_steps, self.min_lr_ratio)
        return VerlSchedule(self.lr_scheduler, self.warmup_steps, self.total_steps, self.min_lr_ratio, self.num_cycles)


def trainer_config_from_workload(workload: Mapping[str, Any]) -> TrainerConfig:
    """The trainer role's config from the job's workload settings (``RLCTL_WORKLOAD``: ``[workload]``
    with the ``algorithm`` table and the job's steps and response cap)."""
    return TrainerConfig(
        lr=float(workload.get("learning_rate", 3e-4)),
        betas=(float(workload.get("adam_beta1", 0.9)), float(workload.get("adam_beta2", 0.99))),
        weight_decay=float(workload.get("weight_decay", 0.0)),
        warmup_steps=int(workload.get("lr_warmup_steps", 5)),
        total_steps=int(workload.get("steps", 0)) if workload.get("lr_scheduler") == "cosine" else 0,
        min_lr_ratio=float(workload.get("min_lr_ratio", 0.0)),
        max_grad_norm=float(workload.get("grad_clip", 1.0)),
        algorithm=AlgorithmSpec.from_table(dict(workload["algorithm"])) if "algorithm" in workload else AlgorithmSpec(),
        micro_batch_tokens=int(workload.get("micro_batch_tokens", TrainerConfig.micro_batch_tokens)),
        sharding=str(workload.get("sharding", TrainerConfig.sharding)),
        lr_scheduler=str(workload.get("lr_scheduler", "warmup-constant")),
        num_cycles=float(workload.get("num_cycles", 0.5)),
        max_response_length=int(workload.get("max_new_tokens", 0)),
    )


class VerlSchedule:
    """verl's learning-rate multipliers over its 0-indexed steps: ``constant`` ramps ``step /
    warmup`` then holds 1; ``cosine`` ramps the same way, then follows ``num_cycles`` cosine waves
    down to ``min_ratio`` at ``total`` steps."""

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float, num_cycles: float) -> None:
        self.kind, self.warmup, self.total, self.min_ratio, self.num_cycles = kind, warmup, total, min_ratio, num_cycles

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.kind == "constant":
            return 1.0
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        wave = math.cos(math.pi * self.num_cycles * 2.0 * progress)
        return max(self.min_ratio, wave * (1 - self.min_ratio) * 0.5 + (1 + self.min_ratio) * 0.5)


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine to ``min_ratio`` at ``total`` (if > 0)."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.total <= self.warmup:
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed_from_env(device: torch.device) -> DistContext:
    """Join the process group described by ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/``MASTER_PORT``.

    Idempotent; a world size of 1 (or unset) means no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        # The controller sizes the collective timeout from the job's phase bounds (rlctl.workload.nccl_env).
        timeout = timedelta(seconds=float(os.environ.get("RLCTL_PG_TIMEOUT_S", DEFAULT_PG_TIMEOUT_S)))
        dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout)
    return DistContext(dist.get_rank(), dist.get_world_size())


def leave_group_and_exit(code: int) -> NoReturn:
    """End a process that may be a rank of a group: leave the group, flush, and exit without
    interpreter finalization.

    A gloo worker thread drops its last collective's tensors just after the main thread's wait
    returns; when that happens while Python finalizes, the thread aborts the whole process
    ("terminate called without an active exception"), after its results were written. Seen on a
    loaded 2-core machine; ``destroy_process_group`` alone does not prevent it, as the device mesh
    still holds the group.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def in_group(distributed: bool | None) -> bool:
    """Whether this trainer is a rank of a group: as asked, else as ``WORLD_SIZE`` says."""
    return distributed if distributed is not None else int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index becomes ``cuda:$LOCAL_RANK`` (one GPU per rank), or ``cuda:0`` when
    the rank sees a single GPU (the agent gave it only its own in ``CUDA_VISIBLE_DEVICES``)."""
    if device.type == "cuda" and device.index is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank if local_rank < torch.cuda.device_count() else 0)
    return device


def micro_batches(sequence_lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Indices cut into micro-batches of similar length: sorted by length, a micro-batch grows until
    its padded size (rows x longest) would pass ``budget_tokens``. A sequence longer than the
    budget gets a micro-batch of its own; ``budget_tokens <= 0`` gives one micro-batch of all."""
    if budget_tokens <= 0:
        return [list(range(len(sequence_lengths)))] if sequence_lengths else []
    batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(sequence_lengths)), key=lambda i: (sequence_lengths[i], i)):
        if current and (len(current) + 1) * sequence_lengths[index] > budget_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def capture_rng_state() -> dict[str, Any]:
    """python/torch/numpy (and CUDA when present) RNG states, in a ``weights_only``-loadable form."""
    np_state = cast(tuple[Any, ...], np.random.get_state())  # the legacy tuple (name, keys, pos, ...)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(payload: Any, path: Path) -> None:
    """``torch.save`` to a temp file in the same folder, fsync, ``os.replace``, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class PreparedStep:
    """A step's samples with what the update needs of each, by the sample's index: its advantage
    row and, where the recipe takes them before the first update, this rank's old and reference
    log-probs (response-aligned, on the CPU)."""

    samples: list[TrainSample]
    advantages: list[Tensor] = field(default_factory=list)
    old_log_probs: dict[int, Tensor] = field(default_factory=dict)
    ref_log_probs: dict[int, Tensor] = field(default_factory=dict)


@dataclass
class OpenStep:
    """A step being trained: the metric sums of its micro-batches (``policy_update.LossSums``), its
    updates' gradient norms, and for a streamed step the counts expected and added so far."""

    started: float
    rewards: list[float] = field(default_factory=list)
    sums: Tensor = field(default_factory=lambda: torch.zeros(METRIC_FIELDS, dtype=torch.float64))
    response_tokens: float = 0.0
    sequences: float = 0.0
    longest: int = 0
    micro_batches: int = 0
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # updates whose gradient norm was not finite
    streamed: bool = False
    expected: Denominators | None = None


class Trainer:
    """Policy model + AdamW + LR schedule; see the module docstring for the contract."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, device: str | torch.device = "cpu",
                 distributed: bool | None = None, compute_dtype: torch.dtype | None = None) -> None:
        self.config = config or TrainerConfig()
        self.device = rank_device(torch.device(device))
        self.model = model.to(self.device)
        self.dist = init_distributed_from_env(self.device) if in_group(distributed) else DistContext()
        if self.config.sharding not in SHARDINGS:
            raise ValueError(f"sharding: expected one of {', '.join(SHARDINGS)}, got {self.config.sharding!r}")
        if self.dist.enabled:
            self._broadcast_parameters()
        self._tied = tied_names(self.model.state_dict())
        self.algorithm = self.config.algorithm
        self.ref_model = self._make_reference() if self.algorithm.needs_reference else None
        self.sharded = self.dist.enabled and self.config.sharding == "fsdp"
        self.compute_dtype = compute_dtype
        if self.sharded:
            shard_model(self.model, self.device, compute_dtype)
            if self.ref_model is not None:
                shard_model(self.ref_model, self.device, compute_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, betas=self.config.betas,
                                           weight_decay=self.config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_multiplier())
        self.step = 0
        self._open_step: OpenStep | None = None

    @classmethod
    def from_hf(cls, path: str | Path, config: TrainerConfig | None = None, device: str | torch.device = "cpu",
                distributed: bool | None = None, dtype: str = "auto", trust_remote_code: bool = False,
                gradient_checkpointing: bool = False) -> Trainer:
        """A trainer on the HF model folder at ``path``; a folder this trainer checkpointed (with
        ``trainer_state.pt``) restores everything, a plain model folder only the weights."""
        from rlctl.workload.hf_model import load_hf_policy, resolve_dtype

        source = Path(path)
        target = rank_device(torch.device(device))
        wanted = resolve_dtype(dtype, target)
        compute_dtype = None
        if in_group(distributed) and (config or TrainerConfig()).sharding == "fsdp" and wanted != torch.float32:
            # FSDP2 mixed precision: float32 master weights and optimizer, layers compute in ``dtype``.
            dtype, compute_dtype = "float32", wanted
        model = load_hf_policy(source, target, dtype, trust_remote_code, gradient_checkpointing)
        trainer = cls(model, config, device, distributed, compute_dtype)
        if (source / TRAINER_STATE_FILE).is_file():
            trainer.load_checkpoint(source)
        return trainer

    def _make_reference(self) -> torch.nn.Module:
        reference = copy.deepcopy(self.model)
        reference.requires_grad_(False)
        return reference.eval()

    def model_signature(self) -> dict[str, Any]:
        """What a checkpoint must match to load here: the model's parameter names and shapes."""
        return {name: list(t.shape) for name, t in self.model.state_dict().items()}

    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)

    def _all_reduce(self, tensor: Tensor) -> Tensor:
        if self.dist.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def _reference_log_prob(self, rows: ResponseRows) -> Tensor:
        assert self.ref_model is not None
        with torch.no_grad():
            return token_log_probs(response_logits(self.ref_model(rows.ids), rows), rows.targets)

    def _forward(self, samples: Sequence[TrainSample]) -> tuple[ResponseRows, Tensor, Tensor]:
        """The policy's response log-probs ``[B, R]`` (with gradient) and their entropy (with
        gradient only when the loss has an entropy term)."""
        rows = response_rows(samples).to(self.device)
        logits = response_logits(self.model(rows.ids), rows)
        log_prob = token_log_probs(logits, rows.targets)
        if self.algorithm.entropy_coeff:
            entropy = entropy_from_logits(logits.float())
        else:
            with torch.no_grad():  # a metric: one row at a time keeps the float32 copies one sequence's size
                entropy = torch.stack([entropy_from_logits(row.float()) for row in logits]) if len(logits) else logits
        return rows, log_prob, entropy

    def _micro_plan(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> list[list[int]]:
        """``indices`` (of ``samples``) in micro-batches of similar length."""
        lengths = [len(samples[i].prompt_tokens) + len(samples[i].response_tokens) for i in indices]
        return [[indices[j] for j in chunk] for chunk in micro_batches(lengths, self.config.micro_batch_tokens)]

    def _local(self, indices: Sequence[int]) -> list[int]:
        """The indices this rank trains: every ``world_size``-th sample of the batch, wherever it falls."""
        return [i for i in indices if i % self.dist.world_size == self.dist.rank]

    def _busiest(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> int:
        """The most micro-batches any rank runs on ``indices`` (every rank can work it out)."""
        world = self.dist.world_size
        return max(len(self._micro_plan(samples, [i for i in indices if i % world == rank])) for rank in range(world))

    def _prepare(self, samples: Sequence[TrainSample]) -> PreparedStep:
        """The samples' advantages (over all of ``samples``: every rank has them) and, where the
        recipe needs them before the first update, this rank's old and reference log-probs, from
        the weights before the update (``AlgorithmSpec.needs_old_pass``)."""
        prepared = PreparedStep(list(samples))
        groups = len({s.prompt_id for s in samples})
        if self.algorithm.needs_old_pass(groups):
            self._old_pass(prepared)
        kl_rows = self._in_reward_kl(prepared) if self.algorithm.use_kl_in_reward and self.algorithm.kl_coef else None
        prepared.advantages = batch_advantages(prepared.samples, self.algorithm, kl_rows)
        return prepared

    def _old_pass(self, prepared: PreparedStep) -> None:
        """This rank's old (and reference) log-probs of its samples, from the weights as they are."""
        samples = prepared.samples
        local = self._local(range(len(samples)))
        plan = self._micro_plan(samples, local)
        extra = self._busiest(samples, range(len(samples))) - len(plan) if self.sharded else 0
        with torch.no_grad():
            for chunk in plan:
                rows = response_rows([samples[i] for i in chunk]).to(self.device)
                old = token_log_probs(response_logits(self.model(rows.ids), rows), rows.targets)
                ref = self._reference_log_prob(rows) if self.ref_model is not None else None
                for row, index in enumerate(chunk):
                    width = len(samples[index].response_tokens)
                    prepared.old_log_probs[index] = old[row, :width].cpu()
                    if ref is not None:
                        prepared.ref_log_probs[index] = ref[row, :width].cpu()
            for _ in range(extra):  # a rank with fewer micro-batches pairs the others' collectives
                rows = response_rows(samples[:1]).to(self.device)
                self.model(rows.ids)
                if self.ref_model is not None:
                    self._reference_log_prob(rows)

    def _in_reward_kl(self, prepared: PreparedStep) -> list[Tensor]:
        """Every sample's in-reward KL row (``kl_penalty`` of the old log-probs against the
        reference's, masked): each rank has its own samples', and they are exchanged."""
        mine = {i: algos.kl_penalty(prepared.old_log_probs[i], prepared.ref_log_probs[i], self.algorithm.kl_penalty)
                * response_mask_of(prepared.samples[i]) for i in prepared.old_log_probs}
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            dist.all_gather_object(gathered, mine)
            mine = {i: row for part in gathered for i, row in part.items()}
        return [mine[i] for i in range(len(prepared.samples))]

    def _accumulate(self, prepared: PreparedStep, indices: Sequence[int], denominators: Denominators) -> int:
        """Forward and backward of this rank's share of ``indices`` in micro-batches, each loss
        aggregated with ``denominators`` (the whole update's), gradients accumulating. Returns the
        micro-batches run."""
        samples = prepared.samples
        plan = self._micro_plan(samples, self._local(indices))
        extra = self._busiest(samples, indices) - len(plan) if self.sharded else 0
        for chunk in plan:
            loss = self._micro_loss(prepared, chunk, denominators)
            loss.backward()
        for _ in range(extra):  # sharded layers gather and reduce in every pass: pair the busiest rank's
            (0.0 * self._micro_loss(prepared, [indices[0]], denominators, record=False)).backward()
        return len(plan)

    def _micro_loss(self, prepared: PreparedStep, chunk: Sequence[int], denominators: Denominators,
                    record: bool = True) -> Tensor:
        rows, log_prob, entropy = self._forward([prepared.samples[i] for i in chunk])
        width = rows.mask.shape[1]
        advantages = padded([prepared.advantages[i] for i in chunk], width).to(self.device)
        if prepared.old_log_probs:
            old = padded([prepared.old_log_probs[i] for i in chunk], width).to(self.device)
        else:
            old = log_prob.detach()
        ref = None
        if self.algorithm.use_kl_loss and self.ref_model is not None:
            ref = (padded([prepared.ref_log_probs[i] for i in chunk], width).to(self.device) if prepared.ref_log_probs
                   else self._reference_log_prob(rows))
        loss, sums = micro_batch_loss(self.algorithm, log_prob, old, advantages, rows.mask, denominators, ref, entropy)
        if record and self._open_step is not None:
            self._open_step.sums += sums.stacked()
        return loss

    def _update(self, rescale: float = 1.0) -> float:
        """One optimizer update from the accumulated gradients (multiplied by ``rescale``): summed over
        a plain data-parallel group, clipped to ``max_grad_norm``. A non-finite norm skips the update,
        as verl does. Returns the norm."""
        if rescale != 1.0:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(rescale)
        if self.dist.enabled and not self.sharded:
            self._all_reduce_gradients()
        clip = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = total_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        elif self._open_step is not None:
            self._open_step.skipped += 1
        return grad_norm

    def _all_reduce_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._all_reduce(flat)
        offset = 0
        for param in params:
            count = param.numel()
            param.grad = flat[offset:offset + count].view_as(param).clone()
            offset += count

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One RL step on the batch (every rank passes the whole batch); returns its metrics.

        The recipe's advantages over the whole batch, then ``ppo_epochs`` passes of
        ``ppo_mini_batch_size``-prompt updates (``policy_update.mini_batch_plan``). Old log-probs
        are taken before the first update where there are several (so the ratio and the clip act
        from the second update on). Each update's loss is aggregated with its own token and sequence
        counts, whatever the ranks and micro-batches: the update of one pass over the mini-batch.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self._open(samples)
        prepared = self._prepare(samples)
        step = self._open_step
        assert step is not None
        cap = self._response_cap(samples)
        for epoch_plan in mini_batch_plan(prepared.samples, self.algorithm, self.step):
            for indices in epoch_plan:
                mini = [prepared.samples[i] for i in indices]
                self.optimizer.zero_grad(set_to_none=True)  # the last update's gradients stay (for inspection)
                step.micro_batches += self._accumulate(prepared, indices, denominators_of(mini, self.algorithm, cap))
                step.grad_norms.append(self._update())
        step.response_tokens = float(sum(s.trained_tokens for s in samples))
        return self._close()

    def _response_cap(self, samples: Sequence[TrainSample]) -> int:
        """``seq-mean-token-sum-norm``'s divisor when ``loss_scale_factor`` is 0: the job's response
        cap, else the step's longest response (a trainer used without a job)."""
        return self.config.max_response_length or max((len(s.response_tokens) for s in samples), default=1)

    def _open(self, samples: Sequence[TrainSample] = ()) -> None:
        if self._open_step is not None:
            raise RuntimeError("a step is already open")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._open_step = OpenStep(time.perf_counter(), [float(s.reward) for s in samples])

    def _close(self) -> dict[str, float]:
        step, self._open_step = self._open_step, None
        assert step is not None
        totals = self._all_reduce(step.sums.clone())
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        updates = max(1, len(step.grad_norms))
        pg_loss, kl_loss, entropy = (float(totals[i]) / updates for i in range(3))
        tokens = max(float(totals[6]), 1.0)
        seconds = time.perf_counter() - step.started
        algorithm = self.algorithm
        loss = pg_loss + (algorithm.kl_loss_coef * kl_loss if algorithm.use_kl_loss else 0.0) \
            - algorithm.entropy_coeff * entropy
        return {"step": float(self.step), "reward_mean": sum(step.rewards) / max(1, len(step.rewards)),
                "loss": loss, "pg_loss": pg_loss, "kl": kl_loss, "kl_loss": kl_loss, "entropy": entropy,
                "clip_frac": float(totals[3]) / tokens, "pg_clipfrac": float(totals[3]) / tokens,
                "ppo_kl": float(totals[4]) / tokens, "pg_clipfrac_lower": float(totals[5]) / tokens,
                "grad_norm": sum(step.grad_norms) / updates, "updates": float(len(step.grad_norms)),
                "updates_skipped": float(step.skipped), "tokens": step.response_tokens,
                "tokens_per_s": step.response_tokens / seconds if seconds > 0 else 0.0,
                "lr": float(lr), "seconds": seconds, "micro_batches": float(step.micro_batches),
                "ranks": float(self.dist.world_size), "sharded": float(self.sharded)}

    def begin_step(self, expected_tokens: float, expected_sequences: float | None = None) -> None:
        """Open a step whose samples come in parts (``add_samples``, then ``finish_step``): the
        stream-based training of RollPacker, forward/backward while later groups still generate.

        One update over the whole batch: each part's loss is aggregated with the expected counts
        (``expected_tokens``: the batch's response tokens, or an estimate while they are not all
        known; ``expected_sequences``: its samples, which the round's target fixes), and
        ``finish_step`` rescales the gradients by expected / actual: the step is the one
        ``train_step`` takes on the whole batch, and the gradients keep their usual size in low
        precision. Recipes that need the whole batch first are refused at the job file
        (``rlctl.core.algorithm``).
        """
        self._open()
        step = self._open_step
        assert step is not None
        step.expected = Denominators(max(float(expected_tokens), 1.0), max(float(expected_sequences or 0.0), 1.0),
                                     float(self.algorithm.loss_scale_factor or self.config.max_response_length or 1))
        # With neither a loss_scale_factor nor the job's cap, the divisor is the step's longest
        # response, known at finish_step: the parts use 1 until then.
        step.streamed = True

    def add_samples(self, samples: Sequence[TrainSample]) -> None:
        """Forward and backward of whole groups of the open step. Every rank passes the same
        samples and takes every ``world_size``-th one; advantages are per group."""
        step = self._open_step
        if step is None or not step.streamed:
            raise RuntimeError("no step is open: call begin_step first")
        if not samples:
            return
        prepared = self._prepare(samples)
        assert step.expected is not None
        step.micro_batches += self._accumulate(prepared, range(len(samples)), step.expected)
        step.rewards.extend(float(s.reward) for s in samples)
        step.response_tokens += float(sum(s.trained_tokens for s in samples))  # every rank has them all
        step.sequences += float(len(samples))
        step.longest = max(step.longest, max(len(s.response_tokens) for s in samples))

    def finish_step(self) -> dict[str, float]:
        """The optimizer update over every sample added since ``begin_step``; returns its metrics."""
        step = self._open_step
        if step is None or not step.rewards or step.expected is None:
            self._open_step = None
            raise ValueError("finish_step needs an open step with at least one sample")
        scale = float(self.algorithm.loss_scale_factor or self.config.max_response_length or step.longest)
        actual = Denominators(max(step.response_tokens, 1.0), step.sequences, scale)
        factor = step.expected.rescale(actual, self.algorithm.loss_agg_mode)
        step.sums[:3] *= factor  # the loss terms were aggregated with the expected counts too
        step.grad_norms.append(self._update(factor))
        return self._close()

    def shard_for_publish(self) -> dict[str, Tensor]:
        """This rank's shard of the weights in the compute dtype (a sharded group's ranks each serve
        theirs; ``rlctl.weights.shards`` puts them together on the receiving side). Not a collective."""
        return local_shards(self.model, self.compute_dtype)  # publishing flattens it: one copy, staged to host

    def weights_to_publish(self) -> dict[str, Tensor]:
        """The model weights as they are, on the trainer's device (version = ``self.step``), for a
        weight server to stage: publishing copies them (chunked, into its reused pinned host
        buffers on CUDA: ``rlctl.weights.staging``), so no host copy is made here. In a group as
        ``state_dict_for_publish``: sharded weights gathered, rank 0 gets them, the others ``{}``."""
        if self.sharded:
            return full_state_dict(self.model)
        if self.dist.rank != 0:
            return {}
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """Detached, contiguous CPU copies of the model weights (version = ``self.step``). In a group
        every rank calls it (sharded weights are gathered); rank 0 gets them, the others ``{}``."""
        if self.sharded:
            return full_state_dict(self.model)
        if self.dist.rank != 0:
            return {}
        return {name: t.detach().to("cpu").contiguous().clone() for name, t in self.model.state_dict().items()}

    def checkpoint_payload(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "model_config": self.model_signature(),
            "trainer_config": self.config.to_dict(),
            "model": self.state_dict_for_publish(),
            "ref_model": ({k: v.detach().cpu() for k, v in self.ref_model.state_dict().items()}
                          if self.ref_model is not None else None),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
        }

    def state_bytes(self) -> bytes:
        """Everything ``save_checkpoint`` writes, serialized in memory (what a peer keeps to resume here)."""
        buffer = io.BytesIO()
        torch.save(self.checkpoint_payload(), buffer)
        return buffer.getvalue()

    def load_state_bytes(self, data: bytes | memoryview) -> int:
        """Restore from ``state_bytes`` output; returns the restored step."""
        payload = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("the bytes are not an rlctl trainer state")
        return self._restore(payload)

    def save_checkpoint(self, path: str | Path, extra_files: Mapping[str, bytes] | None = None) -> Path | None:
        """Atomically write a full checkpoint (rank 0 only; other ranks return None).

        A folder (``save_pretrained`` output, tokenizer files, ``trainer_state.pt`` and
        ``extra_files`` by name) written beside the target and renamed into place. A sharded
        group's ranks all call it (see ``_save_sharded``).
        """
        if self.sharded:
            return self._save_sharded(Path(path), extra_files)
        if self.dist.rank != 0:
            return None
        target = Path(path)
        payload = self.checkpoint_payload()
        del payload["model"]  # the weights are the folder's safetensors
        staging = target.with_name(staged_name(target.name, str(os.getpid())))
        shutil.rmtree(staging, ignore_errors=True)
        try:
            self.model.save(staging)  # type: ignore[operator]
            atomic_torch_save(payload, staging / TRAINER_STATE_FILE)
            for name, data in (extra_files or {}).items():
                (staging / name).write_bytes(data)
            write_manifest(staging)  # last: the checksums appear with the folder they cover
            _replace_folder(staging, target)
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)  # the previous checkpoint stays as it was
            raise CheckpointWriteError(target, exc) from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def _save_sharded(self, target: Path, extra_files: Mapping[str, bytes] | None) -> Path | None:
        """Every rank: gather the full weights to rank 0, write its optimizer shard; rank 0 writes
        the HF folder and the trainer state, then renames the staged folder into place."""
        leader = self.dist.rank == 0
        staging = target.with_name(staged_name(target.name, "group"))  # one name every rank agrees on
        weights = full_state_dict(self.model)
        reference = full_state_dict(self.ref_model) if self.ref_model is not None else None
        rng_states: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(rng_states, capture_rng_state())
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        failed = torch.zeros(1)
        written_here = False
        try:
            save_optimizer(self.model, self.optimizer, staging / OPTIMIZER_SHARDS_DIR)
            if leader:
                self.model.save(staging, state_dict=weights)  # type: ignore[operator]
                atomic_torch_save({
                    "format": CHECKPOINT_FORMAT, "step": self.step, "model_config": self.model_signature(),
                    "trainer_config": self.config.to_dict(), "ref_model": reference, "optimizer": None,
                    "optimizer_shards": OPTIMIZER_SHARDS_DIR, "scheduler": self.scheduler.state_dict(),
                    "rng": rng_states[0], "rank_rng": rng_states,
                }, staging / TRAINER_STATE_FILE)
                for name, data in (extra_files or {}).items():
                    (staging / name).write_bytes(data)
            written_here = True
        except Exception as exc:
            failed += 1
            raise CheckpointWriteError(target, exc) from exc
        finally:
            dist.all_reduce(failed)  # every rank learns whether the folder is whole
            finished = torch.zeros(1)
            if leader and not failed.item():
                try:
                    write_manifest(staging)  # after every rank's shard: the checksums cover them all
                    _replace_folder(staging, target)
                    finished += 1
                except Exception as exc:
                    shutil.rmtree(staging, ignore_errors=True)
                    finished -= 1
                    raise CheckpointWriteError(target, exc) from exc
                finally:
                    dist.all_reduce(finished)
            elif leader:
                shutil.rmtree(staging, ignore_errors=True)  # the previous checkpoint stays as it was
            if not leader and not failed.item():
                dist.all_reduce(finished)
                if finished.item() < 0:
                    raise CheckpointWriteError(target, "rank 0 could not finish the checkpoint folder")
            dist.barrier()
        if written_here and failed.item():  # another rank's shard failed: nothing was renamed into place
            raise CheckpointWriteError(target, f"{int(failed.item())} other rank(s) could not write their shard")
        return target if leader else None

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore everything ``save_checkpoint`` wrote, once its files match their checksums;
        returns the restored step. Raises ``CheckpointCorruptError`` naming the file that does not
        (on every rank of a group: rank 0 checks, the others learn its verdict). A sharded group's
        ranks all call it."""
        source = Path(path)
        self._verify(source)
        state_file = source / TRAINER_STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{source}: no {TRAINER_STATE_FILE} (not a folder an rlctl trainer checkpointed)")
        payload = torch.load(state_file, map_location="cpu", weights_only=True)
        if payload.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{state_file} is not an rlctl trainer state")
        payload["model"] = read_hf_weights(source, self.model.state_dict(), self._tied)
        if self.sharded or payload.get("optimizer_shards"):
            return self._restore_sharded(source, payload)
        return self._restore(payload)

    def _verify(self, source: Path) -> None:
        verdict: list[Any] = [None]
        if self.dist.rank == 0:
            try:
                verify_checkpoint(source)
            except CheckpointCorruptError as exc:
                verdict = [(exc.file, exc.reason)]
        if self.dist.enabled:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointCorruptError(source, *verdict[0])

    def _restore_sharded(self, source: Path, payload: Mapping[str, Any]) -> int:
        if payload["model_config"] != self.model_signature():
            raise ValueError("checkpoint model shape differs from this trainer's model")
        if not self.sharded or not payload.get("optimizer_shards"):
            raise ValueError(f"{source}: a sharded group's checkpoint loads in a sharded group (and only there)")
        load_full_state_dict(self.model, payload["model"])
        if self.ref_model is not None:
            load_full_state_dict(self.ref_model, payload["ref_model"] if payload["ref_model"] is not None
                                 else payload["model"])
        load_optimizer(self.model, self.optimizer, source / str(payload["optimizer_shards"]))
        self.scheduler.load_state_dict(payload["scheduler"])
        per_rank = payload.get("rank_rng") or []
        restore_rng_state(per_rank[self.dist.rank] if self.dist.rank < len(per_rank) else payload["rng"])
        self.step = int(payload["step"])
        return self.step

    def _restore(self, payload: Mapping[str, Any]) -> int:
        if payload["model_config"] != self.model_signature():
            raise ValueError("checkpoint model shape differs from this trainer's model")
        self.model.load_state_dict(payload["model"])
        if self.ref_model is not None:
            # A checkpoint taken without a KL term has no reference: the restored weights become it.
            self.ref_model.load_state_dict(payload["ref_model"] if payload["ref_model"] is not None else payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        restore_rng_state(payload["rng"])
        self.step = int(payload["step"])
        return self.step


def tied_names(state: Mapping[str, Tensor]) -> dict[str, list[str]]:
    """For every name, the other names whose tensor shares its storage (tied embeddings), read
    from an unsharded state dict."""
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return {name: [twin for twin in by_storage[tensor.untyped_storage().data_ptr()] if twin != name]
            for name, tensor in state.items()}


def read_hf_weights(folder: Path, like: Mapping[str, Tensor],
                    tied: Mapping[str, list[str]] | None = None) -> dict[str, Tensor]:
    """The safetensors weights of an HF folder as a full state dict with the keys of ``like``: keys
    ``save_pretrained`` leaves out because they are tied to another (``lm_head.weight`` with tied
    embeddings) are filled from their twin (``tied``: from ``tied_names``; read from ``like`` if not given)."""
    from safetensors.torch import load_file

    from rlctl.workload.modeldir import weight_files

    twins_of = tied if tied is not None else tied_names(like)
    state: dict[str, Tensor] = {}
    for shard in weight_files(folder):
        state.update(load_file(str(folder / shard)))
    for name in like:
        if name not in state:
            twins = [t for t in twins_of.get(name, []) if t in state]
            if not twins:
                raise ValueError(f"{folder}: the checkpoint has no weights for {name}")
            state[name] = state[twins[0]]
    return state


def _replace_folder(staging: Path, target: Path) -> None:
    """Move a finished folder into place; a folder already there (a re-written step) is replaced."""
    old = target.with_name(retired_name(target.name, str(os.getpid())))
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
