"""The GRPO trainer: one optimizer step per batch, atomic checkpoints, optional data parallelism.

Role: the trainer role's compute. ``Trainer.train_step(samples)`` turns one batch of scored
samples (all samples of every prompt group of an RL step) into exactly one optimizer step, so
weights version ``v`` is the model after ``v`` steps (docs/architecture.md, data ops).

Contract:
- The policy loss is on-policy GRPO: old log-probs are the current model's (detached), i.e. the
  weights that generated the batch; the ratio is 1 at the step, and the clip matters only when the
  caller passes ``old_logprobs`` that differ. Loss = token-mean over the whole batch of the
  clipped surrogate plus ``kl_coef`` x k3 KL to a frozen copy of the initial weights.
- The model is a Hugging Face causal LM (``HFPolicy``): weights keep their HF names everywhere.
- ``save_checkpoint`` writes an HF folder atomically (staged beside the target, then renamed):
  the model as ``save_pretrained`` writes it, the tokenizer files, and ``trainer_state.pt`` with
  optimizer, scheduler, reference model, step and the python/torch/numpy RNG states.
  ``load_checkpoint`` followed by ``train_step`` on the retained batches reproduces the
  uninterrupted run's weights exactly (same process layout, same device). ``state_bytes`` /
  ``load_state_bytes`` are the same payload in memory; ``rlctl.workload.rank_state`` holds one
  rank's part of it, for the replica a warm standby keeps.
- A group when ``WORLD_SIZE`` > 1 (env, ``torch.distributed``: gloo on CPU, nccl on CUDA): every
  rank receives the *whole* batch, computes the same advantages, trains on its shard
  (``samples[rank::world]``) after scaling its loss by the global token count, and the gradients
  are summed, so the update equals the single-process one on the whole batch. ``sharding``:
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

from rlctl.core.checkpoint_names import retired_name, staged_name
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
from rlctl.workload.grpo import (
    GRPOConfig,
    LossParts,
    group_advantages,
    grpo_loss_parts,
    sequence_logprobs_from_logits,
    token_entropy,
)
from rlctl.workload.task import PAD_ID

CHECKPOINT_FORMAT = "rlctl-trainer-ckpt-v1"
OPTIMIZER_SHARDS_DIR = "optimizer-shards"  # a sharded group's optimizer state (torch.distributed.checkpoint)
# An HF-format checkpoint is a folder: the model as ``save_pretrained`` writes it (plus the
# tokenizer files), and this file beside it with the optimizer, schedule, RNG and step.
TRAINER_STATE_FILE = "trainer_state.pt"
DEFAULT_PG_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TrainSample:
    """One scored sample, as ``trainer.get_batch`` returns it; grouped by ``prompt_id``."""

    item_id: str
    prompt_id: str
    group_index: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    reward: float
    # A multi-turn episode's observations: (start, length) in the response, not the model's tokens.
    observation_spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSample:
        return cls(str(data["item_id"]), str(data["prompt_id"]), int(data["group_index"]),
                   list(data["prompt_tokens"]), list(data["response_tokens"]), float(data["reward"]),
                   tuple((int(start), int(length)) for start, length in data.get("observation_spans", ())))

    @property
    def trained_tokens(self) -> int:
        """The model's own response tokens (what the loss counts)."""
        return len(self.response_tokens) - sum(length for _, length in self.observation_spans)


@dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, schedule and objective settings (the schedule is linear warmup then cosine)."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 0  # 0: constant after warmup
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # Padded tokens per forward pass: the batch is cut into length-sorted micro-batches whose
    # gradients accumulate, so one long sample does not pad every row (0: the whole batch at once).
    micro_batch_tokens: int = 4096
    sharding: str = "fsdp"  # of a group of ranks: fsdp (FSDP2) or ddp (whole copies, all-reduce)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def collate(samples: Sequence[TrainSample], pad_id: int = PAD_ID) -> tuple[Tensor, Tensor]:
    """Right-padded ``prompt + response`` ids ``[B, T]`` and the response mask ``[B, T-1]``
    aligned with next-token log-probs (mask[b, t] = 1 when token t+1 is a response token the model
    wrote: a multi-turn episode's observations are 0)."""
    width = max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_tokens + sample.response_tokens
        ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        start = len(sample.prompt_tokens) - 1
        mask[row, start:start + len(sample.response_tokens)] = 1.0
        for span_start, length in sample.observation_spans:
            mask[row, start + span_start:start + span_start + length] = 0.0
    return ids, mask


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
class OpenStep:
    """A step between ``begin_step`` and ``finish_step``: what its parts have added so far."""

    started: float
    expected_tokens: float
    rewards: list[float] = field(default_factory=list)
    sums: Tensor = field(default_factory=lambda: torch.zeros(5, dtype=torch.float64))
    response_tokens: float = 0.0
    micro_batches: int = 0


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
        self.ref_model = self._make_reference() if self.config.grpo.kl_coef > 0 else None
        self.sharded = self.dist.enabled and self.config.sharding == "fsdp"
        self.compute_dtype = compute_dtype
        if self.sharded:
            shard_model(self.model, self.device, compute_dtype)
            if self.ref_model is not None:
                shard_model(self.ref_model, self.device, compute_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, betas=self.config.betas,
                                           weight_decay=self.config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(self.config.warmup_steps, self.config.total_steps, self.config.min_lr_ratio))
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

    def _local_parts(self, samples: Sequence[TrainSample], advantages: Tensor) -> LossParts:
        ids, mask = collate(samples)
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(ids)
        logprobs = sequence_logprobs_from_logits(logits, ids)
        ref_logprobs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs = sequence_logprobs_from_logits(self.ref_model(ids), ids)
        return grpo_loss_parts(logprobs, logprobs.detach(), advantages.to(self.device), mask, self.config.grpo,
                               ref_logprobs, token_entropy(logits))

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
        """One optimizer step on the batch (every rank passes the whole batch); returns metrics.

        Each rank takes every ``world_size``-th sample and runs them in micro-batches
        (``micro_batches``), accumulating gradients of ``(policy + kl_coef * kl) / total_tokens``
        where the total counts the whole batch's response tokens: the same gradient as one forward
        over the whole batch, without padding every row to the longest sample.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self.begin_step(float(sum(s.trained_tokens for s in samples)))
        self.add_samples(samples)
        return self.finish_step()

    def begin_step(self, expected_tokens: float) -> None:
        """Open a step whose samples come in parts (``add_samples``, then ``finish_step``): the
        stream-based training of RollPacker, forward/backward while later groups still generate.

        Each part's loss is divided by ``expected_tokens`` (the batch's response tokens, or an
        estimate while they are not all known) and ``finish_step`` rescales the gradients by
        ``expected / actual``: the step is the one ``train_step`` takes on the whole batch, and the
        gradients keep their usual size in low precision.
        """
        if self._open_step is not None:
            raise RuntimeError("a step is already open")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._open_step = OpenStep(time.perf_counter(), max(float(expected_tokens), 1.0))

    def add_samples(self, samples: Sequence[TrainSample]) -> None:
        """Forward and backward of whole groups of the open step. Every rank passes the same
        samples and takes every ``world_size``-th one; advantages are per group."""
        step = self._open_step
        if step is None:
            raise RuntimeError("no step is open: call begin_step first")
        if not samples:
            return
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = group_advantages(rewards, [s.prompt_id for s in samples], self.config.grpo.adv_eps)
        local_index = list(range(self.dist.rank, len(samples), self.dist.world_size))
        local = [samples[i] for i in local_index]
        local_advantages = advantages[local_index]
        plan = micro_batches([len(s.prompt_tokens) + len(s.response_tokens) for s in local],
                             self.config.micro_batch_tokens)
        for chunk in plan:
            parts = self._local_parts([local[i] for i in chunk], local_advantages[chunk])
            ((parts.policy_sum + self.config.grpo.kl_coef * parts.kl_sum) / step.expected_tokens).backward()
            entropy_sum = parts.entropy_sum if parts.entropy_sum is not None else torch.zeros_like(parts.tokens)
            step.sums += torch.stack([parts.policy_sum, parts.kl_sum, parts.clipped_sum, entropy_sum,
                                      parts.tokens]).detach().double().cpu()
        if self.sharded:
            # Sharded layers gather and reduce in every forward/backward: a rank with fewer
            # micro-batches than the busiest one runs more that contribute nothing.
            for _ in range(self._busiest_plan(samples) - len(plan)):
                parts = self._local_parts(samples[:1], advantages[:1])
                (0.0 * (parts.policy_sum + parts.kl_sum)).backward()
        step.rewards.extend(float(r) for r in rewards)
        step.response_tokens += float(sum(s.trained_tokens for s in samples))  # every rank has them all
        step.micro_batches += len(plan)

    def finish_step(self) -> dict[str, float]:
        """The optimizer step over every sample added since ``begin_step``; returns its metrics."""
        step, self._open_step = self._open_step, None
        if step is None or not step.rewards:
            raise ValueError("finish_step needs an open step with at least one sample")
        total_tokens = max(step.response_tokens, 1.0)
        if total_tokens != step.expected_tokens:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(step.expected_tokens / total_tokens)
        totals = self._all_reduce(step.sums)
        if self.dist.enabled and not self.sharded:
            self._all_reduce_gradients()
        grad_norm = total_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        policy, kl, clipped, entropy = (float(totals[i]) / total_tokens for i in range(4))
        seconds = time.perf_counter() - step.started
        return {"step": float(self.step), "reward_mean": sum(step.rewards) / len(step.rewards), "loss": policy + self.config.grpo.kl_coef * kl,
                "kl": kl, "clip_frac": clipped, "entropy": entropy, "grad_norm": grad_norm, "tokens": float(totals[4]),
                "tokens_per_s": float(totals[4]) / seconds if seconds > 0 else 0.0,
                "lr": float(lr), "seconds": seconds,
                "micro_batches": float(step.micro_batches), "ranks": float(self.dist.world_size),
                "sharded": float(self.sharded)}

    def shard_for_publish(self) -> dict[str, Tensor]:
        """This rank's shard of the weights in the compute dtype (a sharded group's ranks each serve
        theirs; ``rlctl.weights.shards`` puts them together on the receiving side). Not a collective."""
        return local_shards(self.model, self.compute_dtype)  # publishing flattens it: one copy, staged to host

    def _busiest_plan(self, samples: Sequence[TrainSample]) -> int:
        """The most micro-batches any rank runs on ``samples`` (every rank can work it out)."""
        world = self.dist.world_size
        return max(len(micro_batches([len(s.prompt_tokens) + len(s.response_tokens) for s in samples[rank::world]],
                                     self.config.micro_batch_tokens)) for rank in range(world))

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
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # the previous checkpoint stays as it was
            raise
        _replace_folder(staging, target)
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
        except Exception:
            failed += 1
            raise
        finally:
            dist.all_reduce(failed)  # every rank learns whether the folder is whole
            if leader:
                if failed.item():
                    shutil.rmtree(staging, ignore_errors=True)  # the previous checkpoint stays as it was
                else:
                    _replace_folder(staging, target)
            dist.barrier()
        return target if leader else None

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore everything ``save_checkpoint`` wrote; returns the restored step. A sharded
        group's ranks all call it."""
        source = Path(path)
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
