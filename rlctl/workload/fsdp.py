"""FSDP2 for the trainer group: parameters, gradients and optimizer state sharded over every rank.

Role: the ``Trainer``'s sharding when its group has more than one rank (``sharding = "fsdp"``, the
default). Each decoder layer is one ``fully_shard`` unit and the whole HF model the root one
(``torch.distributed.fsdp.fully_shard`` over a 1-D device mesh: NCCL on GPU, gloo on CPU). On GPU
the master weights stay float32 and layers compute in the model's dtype (bfloat16) with float32
gradient reduction; on CPU everything is float32.

Gradients are summed, not averaged (``set_gradient_divide_factor(1)``): every rank scales its loss
by the whole batch's token count, so the sum is the single-process gradient, as in the plain
data-parallel path.

The full state (weights to publish, an HF export) is gathered with
``torch.distributed.checkpoint.state_dict`` — a collective every rank enters. The optimizer state
is saved sharded with ``torch.distributed.checkpoint`` (each rank writes its own shard).

A rank's own part of the state in memory (for the trainer-state replica a warm standby keeps) is
its local shards as plain tensors: ``local_shards`` of the weights and ``local_optimizer_state``;
``load_local_shards`` / ``load_local_optimizer_state`` put them back into a group of the same size.
Neither is a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

SHARDINGS = ("fsdp", "ddp")


def hf_root(model: nn.Module) -> nn.Module:
    """The HF model inside an ``HFPolicy`` (its module names are the HF names), or ``model``."""
    inner = getattr(model, "hf_model", None)
    return inner if isinstance(inner, nn.Module) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.layers`` of Qwen, Llama, Mistral...)."""
    for name, module in model.named_modules():
        if name.endswith("model.layers") and isinstance(module, nn.ModuleList):
            return list(module)
    raise ValueError("no decoder layers (an HF *ForCausalLM with model.layers) to shard")


def shard_model(model: nn.Module, device: torch.device, compute_dtype: torch.dtype | None = None) -> None:
    """``fully_shard`` every decoder layer, then the root, over all ranks of the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = hf_root(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else \
        MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights as CPU tensors on rank 0 (other ranks get ``{}``). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(hf_root(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.contiguous() for name, tensor in state.items() if isinstance(tensor, Tensor)}


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Every rank passes the same full state dict; each keeps its shard. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(hf_root(model), dict[str, Any](state), options=StateDictOptions(full_state_dict=True))


def local_shards(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """This rank's shard of every parameter (``DTensor.to_local``: its rows of dim 0, in rank
    order), by HF name; cast to ``dtype`` when given (what goes on the wire)."""
    from torch.distributed.tensor import DTensor

    shards = {name: (t.to_local() if isinstance(t, DTensor) else t).detach()
              for name, t in hf_root(model).state_dict().items()}
    return {name: t.to(dtype) if dtype is not None else t for name, t in shards.items()}


def load_local_shards(model: nn.Module, shards: Mapping[str, Tensor]) -> None:
    """Copy ``local_shards`` output (of a group of the same size, same rank) into this rank's shards:
    every shard is checked first (names, dtypes, shapes, contiguous, one device), so a part that
    does not fit raises ``ValueError`` naming the tensor and loads nothing; then non-blocking
    copies (from pinned memory they overlap), one synchronisation (``weights_load``)."""
    from torch.distributed.tensor import DTensor

    from rlctl.workload.weights_load import load_into

    current = hf_root(model).state_dict()
    missing = sorted(set(current) - set(shards))
    if missing:
        raise ValueError(f"the saved shards lack {missing[:3]}")
    held = {name: tensor.to_local() if isinstance(tensor, DTensor) else tensor for name, tensor in current.items()}
    load_into(held, {name: shards[name] for name in held}, "this rank")


def local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """This rank's optimizer tensors by path (``state/<HF name>/exp_avg``...), every sharded moment as
    its local shard (views, not copies). Works on an unsharded model too (the whole state). An
    optimizer that has not stepped holds none: ``get_optimizer_state_dict`` would make it by a step
    with zero gradients, which counts in Adam's bias correction and so changes every later update."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    found: dict[str, Tensor] = {}
    if not optimizer.state:
        return found

    def keep(local: Tensor, path: tuple[Any, ...]) -> Tensor:
        found["/".join(map(str, path))] = local
        return local

    _map_tensors(get_optimizer_state_dict(hf_root(model), optimizer), keep)
    return found


def load_local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Tensor]) -> None:
    """Restore ``local_optimizer_state`` output of the same rank in a group of the same size (the
    learning rates and other settings stay this optimizer's own)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from rlctl.workload.weights_load import load_into

    if not saved:  # taken before the first step: the optimizer holds nothing yet either
        optimizer.state.clear()
        return
    root = hf_root(model)
    template = get_optimizer_state_dict(root, optimizer)  # the sharded layout, states initialised
    held: dict[str, Tensor] = {}

    def keep(local: Tensor, path: tuple[Any, ...]) -> Tensor:
        held["/".join(map(str, path))] = local
        return local

    _map_tensors(template, keep)
    absent = [key for key in held if key not in saved]
    if absent:
        raise ValueError(f"the saved optimizer state has no {absent[0]} of shape {tuple(held[absent[0]].shape)}")
    load_into(held, {key: saved[key] for key in held}, "this rank's optimizer")  # all checked, then copied
    set_optimizer_state_dict(root, optimizer, template)


def _map_tensors(value: Any, visit: Callable[[Tensor, tuple[Any, ...]], Tensor], path: tuple[Any, ...] = ()) -> Any:
    """``value`` with every tensor ``t`` replaced by ``visit(local of t, path)``; the rest as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return visit(value.to_local(), path)
    if isinstance(value, Tensor):
        return visit(value, path)
    if isinstance(value, dict):
        return {key: _map_tensors(item, visit, (*path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_tensors(item, visit, (*path, index)) for index, item in enumerate(value)]
    return value


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """The optimizer's sharded state into ``folder`` (every rank writes its shard). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(hf_root(model), optimizer)}, checkpoint_id=str(folder))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Restore what ``save_optimizer`` wrote (any rank count that shards the same parameters). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    root = hf_root(model)
    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(root, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(root, optimizer, state["optimizer"])


def total_norm(value: Tensor) -> float:
    """A gradient norm that may be a ``DTensor`` (sharded parameters) as a float."""
    from torch.distributed.tensor import DTensor

    return float(value.full_tensor() if isinstance(value, DTensor) else value)
