"""Sharded point-to-point sync over real holders (TCP): a model split the way fully_shard splits
dim 0, each shard served by its own holder, pulled at once and put together bit for bit; a gone
rank fails the pull cleanly, shards that do not fit are refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from rlctl.weights import WeightError, WeightServerThread, unflatten
from rlctl.weights.errors import WeightIntegrityError
from rlctl.weights.shards import combine, fetch_sharded_sync, fetch_source_sync, shard_rows


def model_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(37, 16, generator=generator, dtype=torch.bfloat16),
        "layers.0.norm.weight": torch.randn(16, generator=generator),
        "layers.0.proj.weight": torch.randn(2, 16, generator=generator),  # fewer rows than ranks
        "lm_head.weight": torch.randn(37, 16, generator=generator, dtype=torch.bfloat16),
    }


def split(state: dict[str, torch.Tensor], ranks: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for rank in range(ranks):
        shard = {}
        for name, tensor in state.items():
            start, stop = shard_rows(tensor.shape[0], ranks, rank)
            shard[name] = tensor[start:stop].contiguous()
        out.append(shard)
    return out


@contextmanager
def serving(shards: list[dict[str, torch.Tensor]], version: int) -> Iterator[tuple[dict, list[WeightServerThread]]]:
    servers = [WeightServerThread("tcp", host="127.0.0.1") for _ in shards]
    try:
        descriptors = []
        for server, shard in zip(servers, shards):
            server.start()
            descriptors.append(server.publish(version, shard))
        yield combine(descriptors, version), servers
    finally:
        for server in servers:
            server.close()


def test_three_ranks_shards_are_pulled_at_once_and_put_together_exactly() -> None:
    state = model_state()
    with serving(split(state, 3), version=5) as (source, _):
        assert source["sharded"] and len(source["shards"]) == 3
        assert source["nbytes"] == sum(d["nbytes"] for d in source["shards"])
        bundle = fetch_sharded_sync(source, timeout=30)
        assert bundle.manifest.version == 5 and fetch_source_sync(source, timeout=30).manifest.checksum == \
            bundle.manifest.checksum
    got = unflatten(bundle.manifest, bundle.buffer)
    assert list(got) == list(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    with serving(split(state, 1), version=6) as (source, _):  # one rank's part is the whole: taken as it came
        whole = fetch_sharded_sync(source, timeout=30)
        assert whole.manifest.version == 6 and whole.manifest.checksum == source["shards"][0]["checksum"]
        assert whole.manifest.checksum == bundle.manifest.checksum, "the same bytes as three parts put together"
    got = unflatten(whole.manifest, whole.buffer)
    assert all(torch.equal(got[name], tensor) for name, tensor in state.items())


def test_a_gone_rank_fails_the_pull_with_a_weight_error() -> None:
    with serving(split(model_state(), 2), version=1) as (source, servers):
        servers[1].close()
        with pytest.raises(WeightError):
            fetch_sharded_sync(source, timeout=5)


def test_shards_that_do_not_fit_together_are_refused() -> None:
    shards = split(model_state(), 2)
    shards[1]["embed.weight"] = shards[1]["embed.weight"][:, :8].contiguous()  # another width
    with serving(shards, version=1) as (source, _), pytest.raises(WeightIntegrityError, match="embed.weight"):
        fetch_sharded_sync(source, timeout=10)


def test_rows_follow_torch_chunk() -> None:
    for rows, ranks in ((37, 3), (2, 3), (8, 4), (0, 2)):
        chunks = [len(c) for c in torch.chunk(torch.arange(rows), ranks)] if rows else []
        held = [shard_rows(rows, ranks, r)[1] - shard_rows(rows, ranks, r)[0] for r in range(ranks)]
        assert [h for h in held if h] == chunks and sum(held) == rows
    assert np.sum([shard_rows(37, 3, r)[0] for r in range(3)]) == 0 + 13 + 26


def test_alignment_gaps_are_zero_so_the_same_weights_have_one_checksum() -> None:
    from rlctl.weights import flatten
    from rlctl.weights.shards import assemble

    state = model_state()
    for bundle in (flatten(state, 1), assemble([flatten(shard, 1) for shard in split(state, 3)], 1)):
        entries = sorted(bundle.manifest.tensors, key=lambda e: e.offset)
        ends = [e.offset + e.nbytes for e in entries]
        gaps = [bundle.buffer[end:nxt.offset] for end, nxt in zip(ends, entries[1:])]
        assert any(len(gap) for gap in gaps) and all(not gap.any() for gap in gaps)
    assert assemble([flatten(s, 1) for s in split(state, 3)], 1).manifest.checksum == \
        assemble([flatten(s, 1) for s in split(state, 2)], 1).manifest.checksum


@pytest.mark.parametrize("transport", ["tcp", "ucx", "ucx-sm"])
def test_one_server_serves_every_part_at_its_index_over_each_transport(transport: str) -> None:
    """A warm standby's copy of a 3-rank group's state: every part from one server, each descriptor
    naming its index; the parts pulled one by one and as one sharded source come back exactly."""
    from rlctl.weights import WeightTransferError, fetch_bundle_sync, flatten
    from rlctl.weights.shards import fetch_parts
    from rlctl.weights.transport_ucx import ucxx_importable

    if transport != "tcp" and not ucxx_importable():
        pytest.skip("ucxx is not importable (the 'ucx' extra)")
    state = model_state()
    parts = [flatten(shard, 6) for shard in split(state, 3)]
    with WeightServerThread(transport, host="127.0.0.1") as server:
        descriptors = server.publish_parts(parts)
        assert [d["index"] for d in descriptors] == [0, 1, 2] and len({d["port"] for d in descriptors}) == 1
        assert server.descriptor() is None, "several parts: no one descriptor stands for them"
        for part, descriptor in zip(parts, descriptors):
            fetched = fetch_bundle_sync(descriptor, timeout=30)
            assert fetched.manifest.checksum == part.manifest.checksum
            assert np.array_equal(fetched.buffer, part.buffer)
        pulled = asyncio.run(fetch_parts(combine(descriptors, 6), timeout=30))
        assert [p.manifest.checksum for p in pulled] == [p.manifest.checksum for p in parts]
        assembled = fetch_sharded_sync(combine(descriptors, 6), timeout=30)
        whole = unflatten(assembled.manifest, assembled.buffer)
        assert all(torch.equal(whole[name], tensor) for name, tensor in state.items())
        with pytest.raises(WeightTransferError, match="no bundle at index 3"):
            fetch_bundle_sync({**descriptors[2], "index": 3}, timeout=10)
        assert fetch_bundle_sync(server.publish_bundle(parts[1]), timeout=30).manifest.checksum == parts[1].manifest.checksum
