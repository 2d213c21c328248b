"""Sharded point-to-point weight sync: every trainer rank serves its own shard, a joiner pulls all.

Role: a sharded trainer group (FSDP2) never gathers the weights to one rank to publish them.
Each rank flattens its own shard of every parameter (rows ``[offset, offset + n)`` along dim 0,
in rank order, as ``fully_shard`` splits them) and serves it from its own ``WeightServer``. Rank 0
combines the ranks' descriptors into one **sharded source**
``{sharded: true, shards: [descriptor of rank 0, ...], version, nbytes, checksum, transport}``
(``combine``), which the controller's registry holds like any other source. A joiner
(``fetch_sharded`` / ``fetch_sharded_sync``) pulls every shard at once on one event loop, checks
each against its descriptor, and writes them straight into one flat bundle of the whole model
(one copy per shard, no intermediate tensors) that it can load and re-serve as an ordinary holder.

No collective: a rank that is gone fails the pull like any holder, and the joiner asks again.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any

from rlctl.weights.bundle import ALIGNMENT, Bundle, Manifest, TensorEntry, compute_checksum
from rlctl.weights.client import DEFAULT_MAX_NBYTES, fetch_bundle, fetch_bundle_sync
from rlctl.weights.errors import WeightIntegrityError
from rlctl.weights.lanes import PullStats
from rlctl.weights.lanes import combine as combine_pulls
from rlctl.weights.staging import HostBufferPool, allocate_host


def combine(descriptors: Sequence[dict[str, Any]], version: int) -> dict[str, Any]:
    """One source for the shards of ``version`` that the group's ranks serve (in rank order)."""
    if not descriptors:
        raise ValueError("a sharded source needs at least one shard")
    checksums = "\n".join(str(d["checksum"]) for d in descriptors).encode()
    return {"sharded": True, "shards": [dict(d) for d in descriptors], "version": version,
            "nbytes": sum(int(d["nbytes"]) for d in descriptors), "transport": descriptors[0]["transport"],
            "checksum": "shards:" + hashlib.sha256(checksums).hexdigest()}


def is_sharded(source: dict[str, Any]) -> bool:
    return bool(source.get("sharded")) and isinstance(source.get("shards"), list)


async def fetch_parts(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      pool: HostBufferPool | None = None) -> list[Bundle]:
    """Every shard of ``source`` at once, each verified against its descriptor, in rank order
    (each into a buffer of ``pool`` when given)."""
    shards = source["shards"]
    bundles = await asyncio.gather(*(fetch_bundle(shard, timeout, max_nbytes, pool=pool) for shard in shards))
    for shard, bundle in zip(shards, bundles):
        if bundle.manifest.version != int(source["version"]):
            raise WeightIntegrityError(f"shard at {shard.get('host')}:{shard.get('port')} sent v"
                                       f"{bundle.manifest.version}, expected v{source['version']}")
    return list(bundles)


async def fetch_sharded(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                        pool: HostBufferPool | None = None) -> Bundle:
    """Every shard of ``source`` at once, verified, assembled into one bundle of the whole model
    (in a buffer of ``pool`` when given); its ``pull`` covers every shard's transfer."""
    started = time.perf_counter()
    whole_in_one = len(source["shards"]) == 1
    bundles = await fetch_parts(source, timeout, max_nbytes, pool if whole_in_one else None)
    if whole_in_one:  # one part is the whole model, verified: nothing to put together
        return bundles[0]
    pulled = time.perf_counter() - started
    stats = [b.pull for b in bundles if b.pull is not None]
    pull = combine_pulls(stats, sum(b.manifest.nbytes for b in bundles), pulled) if stats else None
    return await asyncio.to_thread(assemble, bundles, int(source["version"]), pool, pull)


def fetch_sharded_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                       pool: HostBufferPool | None = None) -> Bundle:
    """Blocking ``fetch_sharded`` (from a thread with no running event loop)."""
    return asyncio.run(fetch_sharded(source, timeout, max_nbytes, pool))


def fetch_source_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      pool: HostBufferPool | None = None) -> Bundle:
    """The whole model from ``source``: one holder's bundle, or a sharded group's shards put together."""
    if is_sharded(source):
        return fetch_sharded_sync(source, timeout, max_nbytes, pool)
    return fetch_bundle_sync(source, timeout, max_nbytes, pool=pool)


def assemble(bundles: Sequence[Bundle], version: int, pool: HostBufferPool | None = None,
             pull: PullStats | None = None) -> Bundle:
    """The whole model from the ranks' shards: each tensor is the concatenation along dim 0 of its
    shards in rank order (in a buffer of ``pool`` when given). Raises ``WeightIntegrityError``
    when the shards do not fit together."""
    first = bundles[0].manifest
    by_name = [{entry.name: entry for entry in bundle.manifest.tensors} for bundle in bundles]
    entries: list[TensorEntry] = []
    offset = 0
    for entry in first.tensors:
        # A 0-dim tensor is not split: every rank holds it whole, and rank 0's copy is taken.
        parts = [names.get(entry.name) for names in (by_name if entry.shape else by_name[:1])]
        if any(part is None or part.dtype != entry.dtype or part.shape[1:] != entry.shape[1:] for part in parts):
            raise WeightIntegrityError(f"the shards of {entry.name!r} do not fit together (names, dtypes or shapes differ)")
        rows = sum(part.shape[0] for part in parts if part is not None and part.shape)
        shape = (rows, *entry.shape[1:]) if entry.shape else entry.shape
        nbytes = sum(part.nbytes for part in parts if part is not None)
        offset = (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        entries.append(TensorEntry(entry.name, entry.dtype, shape, offset, nbytes))
        offset += nbytes
    if any(len(names) != len(first.tensors) for names in by_name):
        raise WeightIntegrityError("the shards name different tensors")
    if pool is None:
        host = allocate_host(offset, pin=False)
        return _assemble_into(host.view(offset), bundles, entries, by_name, version, first.kind, pull, host.hold)
    with pool.reserve(offset) as host:
        return _assemble_into(host.view(offset), bundles, entries, by_name, version, first.kind, pull, host.hold)


def _assemble_into(buffer: Any, bundles: Sequence[Bundle], entries: list[TensorEntry],
                   by_name: list[dict[str, TensorEntry]], version: int, kind: str, pull: PullStats | None,
                   hold: Any) -> Bundle:
    at = 0
    for whole in entries:
        buffer[at:whole.offset] = 0  # alignment gaps, as flatten: a deterministic checksum
        at = whole.offset
        for bundle, names in zip(bundles if whole.shape else bundles[:1], by_name):
            part = names[whole.name]
            buffer[at:at + part.nbytes] = bundle.buffer[part.offset:part.offset + part.nbytes]
            at += part.nbytes
    buffer[at:] = 0
    manifest = Manifest(version=version, nbytes=buffer.nbytes, checksum=compute_checksum(buffer), kind=kind,
                        tensors=tuple(entries))
    bundle = Bundle(manifest=manifest, buffer=buffer, pull=pull)
    hold(bundle)
    return bundle


def shard_rows(total_rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``total_rows`` tensor that ``rank`` holds (``torch.chunk`` order,
    as ``fully_shard`` splits dim 0)."""
    chunk = math.ceil(total_rows / ranks) if total_rows else 0
    start = min(rank * chunk, total_rows)
    return start, min(start + chunk, total_rows)
