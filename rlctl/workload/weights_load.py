"""Loading weights into a model's own tensors: every tensor checked first, then copied straight in.

Role: the last step of a pull (a rollout engine taking a version, a warm standby taking over, a
trainer restoring its part of the state from a replica). ``check_state`` refuses, naming the
tensor, a state that does not fit what the model holds: a name it does not hold or one it lacks,
another dtype or shape, a non-contiguous tensor, or tensors spread over two devices (host and
GPU). Only when every tensor passes does ``load_into`` copy anything, so bad input leaves the
model as it was, never half-loaded.

The copies go from where the tensors are (the received host buffer, pinned when the pool could
pin it) straight into the model's tensors with ``non_blocking`` copies, one synchronisation at
the end: from pinned memory the host-to-GPU copies run at the link's rate and overlap each
other; nothing is staged through a pageable intermediate.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoadStats:
    """One load: bytes copied, seconds (to the end of the last copy), the model's device, and
    whether the host source was pinned."""

    nbytes: int
    seconds: float
    device: str
    pinned_source: bool

    @property
    def gbps(self) -> float:
        return float(f"{self.nbytes / self.seconds / 1e9:.4g}") if self.seconds > 0 else 0.0


def _as_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    return value


def check_state(held: Mapping[str, Any], state: Mapping[str, Any], what: str = "the model",
                optional: Collection[str] = ()) -> dict[str, Any]:
    """``state``'s tensors (numpy arrays as torch views) when every one fits ``held``: the same
    names (those in ``optional`` may be left out), dtypes and shapes, contiguous, all on one
    device. Raises ``ValueError`` (``TypeError`` for a value that is no tensor) naming the first
    tensor that does not."""
    unknown = [name for name in state if name not in held]
    if unknown:
        raise ValueError(f"tensor {unknown[0]!r} is not one {what} holds ({len(unknown)} such: {unknown[:3]})")
    missing = [name for name in held if name not in state and name not in optional]
    if missing:
        raise ValueError(f"tensor {missing[0]!r} of {what} is missing from the state ({len(missing)} missing: "
                         f"{missing[:3]})")
    tensors: dict[str, Any] = {}
    first_device: tuple[str, str] | None = None
    for name, value in state.items():
        try:
            tensor = _as_tensor(value)
        except TypeError as exc:
            raise TypeError(f"tensor {name!r}: {exc}") from None
        target = held[name]
        if tensor.dtype != target.dtype:
            raise ValueError(f"tensor {name!r} is {_dtype(tensor.dtype)}, {what} holds {_dtype(target.dtype)}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, {what} holds {list(target.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous (strides {list(tensor.stride())}): load from a "
                             "contiguous copy")
        device = str(tensor.device)
        if first_device is None:
            first_device = (name, device)
        elif device != first_device[1]:
            raise ValueError(f"tensor {name!r} is on {device} but tensor {first_device[0]!r} is on {first_device[1]}: "
                             "a state is loaded from one device")
        tensors[name] = tensor
    return tensors


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def load_into(held: Mapping[str, Any], state: Mapping[str, Any], what: str = "the model",
              optional: Collection[str] = ()) -> LoadStats:
    """Copy ``state`` into ``held`` (the model's own tensors, e.g. ``module.state_dict()``) after
    ``check_state`` passed; blocking until the last copy landed."""
    import torch

    tensors = check_state(held, state, what, optional)
    started = time.perf_counter()
    devices = set()
    nbytes = 0
    pinned = bool(tensors) and torch.cuda.is_available()
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = held[name]
            if tensor.device.type == "cpu" and target.device.type != "cpu":
                pinned = pinned and tensor.is_pinned()
            target.copy_(tensor, non_blocking=True)
            devices.add(target.device)
            nbytes += tensor.numel() * tensor.element_size()
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    device = str(next(iter(devices))) if devices else "cpu"
    return LoadStats(nbytes=nbytes, seconds=time.perf_counter() - started, device=device,
                     pinned_source=pinned and any(d.type == "cuda" for d in devices))
