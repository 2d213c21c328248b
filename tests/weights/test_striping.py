"""Striped pulls over real holders, on every transport: one version from three full holders at
once, a byte range from each, put together bit for bit; a holder that is gone costs its stripe a
second try from the others, not the pull; with no holder left the error names the one that failed."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rlctl.weights import WeightServerThread, flatten
from rlctl.weights.bundle import ALIGNMENT, byte_range
from rlctl.weights.striping import StripeError, fetch_striped_sync, stripes

HAS_UCXX = importlib.util.find_spec("ucxx") is not None
needs_ucxx = pytest.mark.skipif(not HAS_UCXX, reason="ucxx (the 'ucx' extra) is not installed")
TRANSPORTS = ["tcp", pytest.param("ucx", marks=needs_ucxx), pytest.param("ucx-sm", marks=needs_ucxx)]


def model_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {"embed.weight": torch.randn(300, 64, generator=generator, dtype=torch.bfloat16),
            "norm.weight": torch.randn(64, generator=generator),
            "lm_head.weight": torch.randn(300, 64, generator=generator)}


@contextmanager
def holders(transport: str, count: int, version: int) -> Iterator[tuple[list[dict], list[WeightServerThread], bytes]]:
    bundle = flatten(model_state(), version)
    servers = [WeightServerThread(transport, host="127.0.0.1") for _ in range(count)]
    try:
        descriptors = []
        for server in servers:
            server.start()
            descriptors.append(server.publish_bundle(bundle))
        yield descriptors, servers, bytes(bundle.buffer)
    finally:
        for server in servers:
            server.close()


def test_stripes_cover_the_buffer_in_aligned_cuts() -> None:
    parts = stripes(10 * ALIGNMENT + 5, 3)
    assert [o for o, _ in parts] == [0, 4 * ALIGNMENT, 8 * ALIGNMENT] and sum(n for _, n in parts) == 10 * ALIGNMENT + 5
    assert stripes(10, 4) == [(0, 10), (10, 0), (10, 0), (10, 0)]
    assert byte_range(None, 9) == (0, 9) and byte_range([2, 7], 9) == (2, 7)
    for bad in ([5, 5], [-1, 2], [1], "0-4"):
        with pytest.raises(ValueError):
            byte_range(bad, 9)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_three_holders_each_serve_a_stripe_of_one_version(transport: str) -> None:
    with holders(transport, 3, version=4) as (sources, _, expected):
        bundle = fetch_striped_sync(sources, timeout=30)
        assert bundle.manifest.version == 4 and bytes(bundle.buffer) == expected


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_gone_holder_costs_its_stripe_a_second_try_not_the_pull(transport: str) -> None:
    with holders(transport, 3, version=2) as (sources, servers, expected):
        servers[1].close()
        assert bytes(fetch_striped_sync(sources, timeout=20).buffer) == expected


def test_with_no_holder_left_the_error_names_the_one_that_failed() -> None:
    with holders("tcp", 2, version=1) as (sources, servers, _):
        for server in servers:
            server.close()
        with pytest.raises(StripeError) as failure:
            fetch_striped_sync(sources, timeout=5)
        assert failure.value.failed == sources[0]


def test_holders_of_different_versions_are_not_striped() -> None:
    with (holders("tcp", 1, version=1) as (first, _, _), holders("tcp", 1, version=2) as (second, _, _),
          pytest.raises(ValueError, match="same version")):
        fetch_striped_sync(first + second, timeout=5)
