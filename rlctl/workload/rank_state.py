"""One rank's part of the trainer state, as tensors: what a warm standby keeps of every rank.

Role: the trainer-state replica (``[spares] replicate_trainer_state``). A rank of a sharded
(FSDP2) group holds only its own shards of the weights, the reference model and the optimizer
moments: about ``1 / ranks`` of the state, never gathered. A lone trainer's part is its whole
state. The part is a flat name → tensor map that the weight server serves as it is (one copy into
the served buffer, one checksum; no pickling of the big tensors):

- ``model/<HF name>``, ``ref/<HF name>``: the rank's shards (float32 masters);
- ``optim/state/<HF name>/<moment>``: the rank's optimizer tensors;
- ``meta``: a small pickled record (format, rank, group size, step, model shape, schedule and the
  optimizer's learning rates, RNG).

A fresh group of the same size loads each rank's part back into the same rank (``fully_shard``
splits the same way) and steps on exactly as the group that kept running. Neither direction is a
collective.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlctl.workload.fsdp import load_local_optimizer_state, load_local_shards, local_optimizer_state, local_shards

if TYPE_CHECKING:
    from rlctl.workload.trainer import Trainer

RANK_STATE_FORMAT = "rlctl-trainer-rank-state-v2"
META_KEY = "meta"


def rank_state(trainer: Trainer) -> dict[str, Tensor]:
    """This rank's part of ``trainer``'s state (views of the live tensors: serve or copy it before
    the next step changes them)."""
    from rlctl.workload.trainer import capture_rng_state

    meta = {"format": RANK_STATE_FORMAT, "rank": trainer.dist.rank, "world_size": trainer.dist.world_size,
            "sharded": trainer.sharded, "step": trainer.step, "model_config": trainer.model_signature(),
            "scheduler": trainer.scheduler.state_dict(), "rng": capture_rng_state(),
            # The learning rate the schedule set last lives here, not in the scheduler's own state.
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]}
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    # On the trainer's device like the shards: a part is published from one device (rlctl.weights.bundle).
    part = {META_KEY: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(trainer.device)}
    part.update({f"model/{name}": t for name, t in local_shards(trainer.model).items()})
    if trainer.ref_model is not None:
        part.update({f"ref/{name}": t for name, t in local_shards(trainer.ref_model).items()})
    # Adam keeps its step counters on the CPU beside CUDA moments: moved (a few bytes each) so the part is on one device.
    part.update({f"optim/{path}": t.to(trainer.device)
                 for path, t in local_optimizer_state(trainer.model, trainer.optimizer).items()})
    return part


def load_rank_state(trainer: Trainer, part: Mapping[str, Tensor]) -> int:
    """Restore ``rank_state`` output of this rank (same rank, same group size); returns the step.
    Raises ``ValueError`` when the part is not this rank's of this model's state."""
    from rlctl.workload.trainer import restore_rng_state

    meta = _meta(part)
    if (meta["rank"], meta["world_size"], meta["sharded"]) != (trainer.dist.rank, trainer.dist.world_size, trainer.sharded):
        raise ValueError(f"the state is rank {meta['rank']} of {meta['world_size']}, this is rank "
                         f"{trainer.dist.rank} of {trainer.dist.world_size}")
    if meta["model_config"] != trainer.model_signature():
        raise ValueError("the state's model shape differs from this trainer's model")
    load_local_shards(trainer.model, _section(part, "model/"))
    if trainer.ref_model is not None:  # a state taken without a KL term: the restored weights become the reference
        load_local_shards(trainer.ref_model, _section(part, "ref/") or _section(part, "model/"))
    load_local_optimizer_state(trainer.model, trainer.optimizer, _section(part, "optim/"))
    for group, saved in zip(trainer.optimizer.param_groups, meta["param_groups"], strict=True):
        group.update(saved)
    trainer.scheduler.load_state_dict(meta["scheduler"])
    restore_rng_state(meta["rng"])
    trainer.step = int(meta["step"])
    return trainer.step


def _meta(part: Mapping[str, Tensor]) -> dict[str, Any]:
    raw = part.get(META_KEY)
    try:
        meta = torch.load(io.BytesIO(raw.cpu().numpy().tobytes()), map_location="cpu", weights_only=True) if raw is not None else None
    except Exception as exc:  # any unpickling failure means the same: not a state
        raise ValueError(f"the part's {META_KEY} does not load ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != RANK_STATE_FORMAT:
        raise ValueError("the tensors are not one rank's rlctl trainer state")
    return meta


def _section(part: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {name[len(prefix):]: t for name, t in part.items() if name.startswith(prefix)}
