"""Optimizer-state offload for colocated trainers (``[roles.rollout] placement = "colocated"``).

While the engines on the same GPUs generate, the trainer needs none of its AdamW moments: they
move to host memory and return before the next step (sharded state moves shard by shard: a
DTensor's ``to`` keeps its placement). Only
tensors on the accelerator move, and exactly those come back: AdamW keeps its ``step`` counter
on the CPU unless it is capturable, and it must stay there. On a CPU trainer there is nothing to
move and both calls are free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OptimizerOffload:
    """Moves one optimizer's state to host memory and back; ``moved_bytes`` the last move's size."""

    optimizer: torch.optim.Optimizer
    compute_device: torch.device
    moved_bytes: int = 0
    _offloaded: list[tuple[dict[str, Any], str]] = field(default_factory=list)

    def offload(self) -> int:
        """State on the compute device to host memory; returns the bytes moved (0 on a CPU trainer)."""
        if self._offloaded or self.compute_device.type == "cpu":
            return 0
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type == self.compute_device.type:
                    state[key] = value.to("cpu")
                    self._offloaded.append((state, key))
                    moved += value.numel() * value.element_size()
        if self.compute_device.type == "cuda":
            torch.cuda.empty_cache()
        self.moved_bytes = moved
        return moved

    def reload(self) -> int:
        """Bring back what ``offload`` moved; returns the bytes moved."""
        moved = 0
        for state, key in self._offloaded:
            value = state[key]
            state[key] = value.to(self.compute_device)
            moved += value.numel() * value.element_size()
        self._offloaded.clear()
        return moved
