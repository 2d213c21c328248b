"""Loading weights into an engine: bad input gets an error naming the tensor and loads nothing; good
input lands bit for bit from a flat bundle (the received form), awake or asleep."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlctl.weights import flatten, unflatten
from rlctl.workload.engine import SamplingConfig, TorchEngine
from rlctl.workload.hf_init import random_policy
from rlctl.workload.weights_load import load_into


def _engine() -> TorchEngine:
    return TorchEngine(random_policy(size="tiny", seed=0), SamplingConfig(), device="cpu")


def _snapshot(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.model.state_dict().items()}  # type: ignore[attr-defined]


def _first_matrix(state: dict[str, torch.Tensor]) -> str:
    return next(name for name, t in state.items() if t.dim() == 2)


def _mixed(state: dict[str, torch.Tensor]) -> None:
    name = list(state)[-1]
    state[name] = torch.zeros_like(state[name], device="meta")


def _strided(state: dict[str, torch.Tensor]) -> None:
    name = _first_matrix(state)
    state[name] = state[name].t().contiguous().t()


def _dtype(state: dict[str, torch.Tensor]) -> None:
    name = _first_matrix(state)
    state[name] = state[name].to(torch.float64)


def _shape(state: dict[str, torch.Tensor]) -> None:
    name = _first_matrix(state)
    state[name] = state[name][:-1]


def _unknown(state: dict[str, torch.Tensor]) -> None:
    state["model.layers.99.mlp.extra.weight"] = torch.zeros(2)


def _missing(state: dict[str, torch.Tensor]) -> None:
    del state[_first_matrix(state)]


BAD_INPUTS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    ("two devices", _mixed, r"tensor '.*' is on meta but tensor '.*' is on cpu"),
    ("non-contiguous", _strided, r"tensor '.*' is not contiguous"),
    ("dtype", _dtype, r"tensor '.*' is float64, the engine holds float32"),
    ("shape", _shape, r"tensor '.*' has shape \[.*\], the engine holds \[.*\]"),
    ("unknown name", _unknown, r"tensor 'model.layers.99.mlp.extra.weight' is not one the engine holds"),
    ("missing name", _missing, r"tensor '.*' of the engine is missing from the state"),
]


@pytest.mark.parametrize("asleep", [False, True], ids=["awake", "asleep"])
def test_bad_input_is_refused_naming_the_tensor_and_nothing_is_loaded(asleep: bool) -> None:
    engine = _engine()
    before = _snapshot(engine)
    newer = {name: t + 1 if t.is_floating_point() else t.clone() for name, t in before.items()}
    if asleep:
        engine.sleep()
    for what, spoil, message in BAD_INPUTS:
        state = dict(newer)
        spoil(state)
        with pytest.raises(ValueError, match=message):
            engine.load_state_dict(state, 5)
        assert engine.asleep == asleep and engine.version == 0, what
    engine.load_state_dict(before, 0)  # wakes it if asleep
    after = _snapshot(engine)
    assert all(torch.equal(after[name], t) for name, t in before.items())  # no bad input left a trace


def test_a_flat_bundle_loads_bit_for_bit_into_a_sleeping_engine_and_reports_the_copy() -> None:
    source, engine = _engine(), TorchEngine(random_policy(size="tiny", seed=1), SamplingConfig(), device="cpu")
    bundle = flatten(source.model.state_dict(), 3)  # type: ignore[attr-defined]
    engine.sleep()
    engine.load_state_dict(unflatten(bundle.manifest, bundle.buffer), 3)
    assert not engine.asleep and engine.version == 3
    loaded = _snapshot(engine)
    assert all(torch.equal(loaded[name], t) for name, t in _snapshot(source).items())
    stats = engine.last_load
    assert stats.nbytes > 0 and stats.device == "cpu" and not stats.pinned_source


def test_load_into_refuses_a_value_that_is_not_a_tensor() -> None:
    with pytest.raises(TypeError, match="tensor 'w': expected a torch.Tensor"):
        load_into({"w": torch.zeros(2)}, {"w": [1.0, 2.0]})
