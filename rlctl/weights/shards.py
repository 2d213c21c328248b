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
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlctl.weights.bundle import ALIGNMENT, Bundle, Manifest, TensorEntry, compute_checksum
from rlctl.weights.client import DEFAULT_MAX_NBYTES, fetch_bundle, fetch_bundle_sync
from rlctl.weights.errors import WeightIntegrityError


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


async def fetch_parts(source: dict[str, Any], timeout: float = 60.0,
                      max_nbytes: int = DEFAULT_MAX_NBYTES) -> list[Bundle]:
    """Every shard of ``source`` at once, each verified against its descriptor, in rank order."""
    shards = source["shards"]
    bundles = await asyncio.gather(*(fetch_bundle(shard, timeout, max_nbytes) for shard in shards))
    for shard, bundle in zip(shards, bundles):
        if bundle.manifest.version != int(source["version"]):
            raise WeightIntegrityError(f"shard at {shard.get('host')}:{shard.get('port')} sent v"
                                       f"{bundle.manifest.version}, expected v{source['version']}")
    return list(bundles)


async def fetch_sharded(source: dict[str, Any], timeout: float = 60.0,
                        max_nbytes: int = DEFAULT_MAX_NBYTES) -> Bundle:
    """Every shard of ``source`` at once, verified, assembled into one bundle of the whole model."""
    bundles = await fetch_parts(source, timeout, max_nbytes)
    if len(bundles) == 1:  # one part is the whole model, verified: nothing to put together
        return bundles[0]
    return await asyncio.to_thread(assemble, bundles, int(source["version"]))


def fetch_sharded_sync(source: dict[str, Any], timeout: float = 60.0,
                       max_nbytes: int = DEFAULT_MAX_NBYTES) -> Bundle:
    """Blocking ``fetch_sharded`` (from a thread with no running event loop)."""
    return asyncio.run(fetch_sharded(source, timeout, max_nbytes))


def fetch_source_sync(source: dict[str, Any], timeout: float = 60.0,
                      max_nbytes: int = DEFAULT_MAX_NBYTES) -> Bundle:
    """The whole model from ``source``: one holder's bundle, or a sharded group's shards put together."""
    if is_sharded(source):
        return fetch_sharded_sync(source, timeout, max_nbytes)
    return fetch_bundle_sync(source, timeout, max_nbytes)


def assemble(bundles: Sequence[Bundle], version: int) -> Bundle:
    """The whole model from the ranks' shards: each tensor is the concatenation along dim 0 of its
    shards in rank order. Raises ``WeightIntegrityError`` when the shards do not fit together."""
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
    buffer = np.zeros(offset, dtype=np.uint8)  # zeroed alignment gaps, as flatten: a deterministic checksum
    for whole in entries:
        at = whole.offset
        for bundle, names in zip(bundles if whole.shape else bundles[:1], by_name):
            part = names[whole.name]
            buffer[at:at + part.nbytes] = bundle.buffer[part.offset:part.offset + part.nbytes]
            at += part.nbytes
    manifest = Manifest(version=version, nbytes=offset, checksum=compute_checksum(buffer), kind=first.kind,
                        tensors=tuple(entries))
    return Bundle(manifest=manifest, buffer=buffer)


def shard_rows(total_rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``total_rows`` tensor that ``rank`` holds (``torch.chunk`` order,
    as ``fully_shard`` splits dim 0)."""
    chunk = math.ceil(total_rows / ranks) if total_rows else 0
    start = min(rank * chunk, total_rows)
    return start, min(start + chunk, total_rows)
