"""Flat bundles: flatten/unflatten round trips, zero-copy views, verification, manifest validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.weights import WeightIntegrityError, compute_checksum, flatten, unflatten, verify
from rlctl.weights.bundle import ALIGNMENT, Manifest

TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 50).to(dtype)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TORCH_DTYPES), st.lists(st.integers(0, 5), max_size=3)), max_size=6),
       st.integers(0, 2**31))
def test_torch_round_trip_any_dtype_and_shape(specs: list[tuple[torch.dtype, list[int]]], version: int) -> None:
    state = {f"t{i}": _tensor(dtype, tuple(shape), i) for i, (dtype, shape) in enumerate(specs)}
    bundle = flatten(state, version)
    assert bundle.manifest.version == version
    verify(bundle.manifest, bundle.buffer, version, bundle.manifest.checksum)
    rebuilt = unflatten(Manifest.from_json(json.loads(bundle.manifest.to_bytes())), bundle.buffer)
    assert list(rebuilt) == list(state)
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype and rebuilt[name].shape == tensor.shape
        assert torch.equal(rebuilt[name], tensor)


def test_offsets_are_aligned_and_views_share_the_buffer() -> None:
    state = {"a": torch.ones(3, dtype=torch.int8), "b": torch.arange(5, dtype=torch.float64), "c": torch.zeros(0)}
    bundle = flatten(state, 1)
    assert all(entry.offset % ALIGNMENT == 0 for entry in bundle.manifest.tensors)
    rebuilt = unflatten(bundle.manifest, bundle.buffer)
    base = bundle.buffer.ctypes.data
    assert rebuilt["b"].data_ptr() == base + bundle.manifest.tensors[1].offset
    rebuilt["b"][0] = 42.0
    assert unflatten(bundle.manifest, bundle.buffer)["b"][0].item() == 42.0


def test_flatten_is_a_snapshot_and_packs_non_contiguous_tensors() -> None:
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bundle = flatten({"t": source.t()}, 2)
    source.zero_()
    assert torch.equal(unflatten(bundle.manifest, bundle.buffer)["t"], torch.arange(12.0).reshape(3, 4).t())


def test_numpy_state_round_trips_as_numpy() -> None:
    state = {"w": np.arange(10, dtype=np.float32).reshape(2, 5), "i": np.array([1, 2, 3], dtype=np.int64)}
    bundle = flatten(state, 4)
    assert bundle.manifest.kind == "numpy"
    rebuilt = unflatten(bundle.manifest, bundle.buffer)
    for name, array in state.items():
        assert isinstance(rebuilt[name], np.ndarray)
        np.testing.assert_array_equal(rebuilt[name], array)


def test_flipped_byte_version_and_checksum_mismatches_raise() -> None:
    bundle = flatten({"w": torch.randn(1000)}, 5)
    with pytest.raises(WeightIntegrityError, match="version mismatch"):
        verify(bundle.manifest, bundle.buffer, expected_version=6)
    with pytest.raises(WeightIntegrityError, match="checksum mismatch"):
        verify(bundle.manifest, bundle.buffer, expected_checksum="sha256:" + "0" * 64)
    bundle.buffer[100] ^= 0xFF
    with pytest.raises(WeightIntegrityError, match="received bytes hash to"):
        verify(bundle.manifest, bundle.buffer, 5, bundle.manifest.checksum)


def test_checksum_is_self_describing_sha256_without_xxhash() -> None:
    buffer = np.frombuffer(b"abc", dtype=np.uint8)
    assert compute_checksum(buffer, "sha256") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    with pytest.raises(WeightIntegrityError, match="unknown checksum algorithm"):
        compute_checksum(buffer, "md5")


@pytest.mark.parametrize("patch", [
    {"format": 99},
    {"kind": "pickle"},
    {"nbytes": -1},
    {"tensors": [{"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 15}]},
    {"tensors": [{"name": "x", "dtype": "float32", "shape": [4], "offset": 2, "nbytes": 16}]},
    {"tensors": [{"name": "x", "dtype": "float32", "shape": [1000], "offset": 0, "nbytes": 4000}]},
    {"tensors": [{"name": "x", "dtype": "no_such_dtype", "shape": [1], "offset": 0, "nbytes": 4}]},
    {"tensors": [{"name": "x", "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4}] * 2},
    {"checksum": "deadbeef"},
])
def test_malformed_manifests_are_rejected(patch: dict[str, object]) -> None:
    good = flatten({"x": torch.zeros(4)}, 1).manifest.to_json()
    with pytest.raises(WeightIntegrityError):
        Manifest.from_json({**good, **patch})


def test_flatten_rejects_non_tensors_and_bad_versions() -> None:
    with pytest.raises(TypeError):
        flatten({"x": [1, 2, 3]}, 1)
    with pytest.raises(ValueError):
        flatten({"x": torch.zeros(1)}, -1)
