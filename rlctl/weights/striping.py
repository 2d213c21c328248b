"""Striped pulls: a joiner takes one version from several full holders at once, a byte range from each.

Role: a rejoining node (a replaced rollout, a restored trainer) would otherwise pull the whole
model from one holder, so its link and that holder's alone set the time. ``fetch_striped`` cuts
the flat buffer into one contiguous stripe per holder (aligned, in holder order), asks every holder
for its stripe at once over the holder's own transport (TCP, UCX or UCX shared memory all take a
``range``), lands each stripe straight in its place in one buffer, and verifies the whole buffer
against the version's checksum before anything is used.

A holder that fails its stripe is named in the ``StripeError``; the stripe is first taken again
from the holders that answered, so one dead holder costs time, not the pull. Every holder must
serve the same version with the same checksum (the controller's registry gives them so).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlctl.weights.bundle import ALIGNMENT, Buffer, Bundle, Manifest, verify
from rlctl.weights.client import receive_raw
from rlctl.weights.errors import WeightIntegrityError, WeightTransferError
from rlctl.weights.transport_tcp import DEFAULT_MAX_NBYTES


class StripeError(WeightTransferError):
    """A stripe could not be had from any holder; ``failed`` is the first holder that failed it."""

    def __init__(self, message: str, failed: dict[str, Any]) -> None:
        super().__init__(message)
        self.failed = failed


def stripes(nbytes: int, holders: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each holder's stripe: contiguous, ``ALIGNMENT``-aligned cuts, the
    last one taking the rest; an empty stripe where the buffer is too small to share."""
    if holders < 1:
        raise ValueError("striping needs at least one holder")
    size = -(-nbytes // holders)
    size = -(-size // ALIGNMENT) * ALIGNMENT
    cuts = [min(nbytes, i * size) for i in range(holders + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(holders)]


async def fetch_striped(sources: Sequence[dict[str, Any]], timeout: float = 60.0,
                        max_nbytes: int = DEFAULT_MAX_NBYTES) -> Bundle:
    """One version from every holder in ``sources`` at once, a stripe each, verified as a whole."""
    if not sources:
        raise ValueError("fetch_striped needs at least one source")
    first = sources[0]
    mismatched = [s for s in sources if (s["version"], s["checksum"], s["nbytes"]) !=
                  (first["version"], first["checksum"], first["nbytes"])]
    if mismatched:
        raise ValueError("striped sources must serve the same version with the same checksum and size")
    nbytes = int(first["nbytes"])
    if nbytes > max_nbytes:
        raise WeightTransferError(f"the version is {nbytes} bytes, above the bound of {max_nbytes}")
    buffer: Buffer = np.empty(nbytes, dtype=np.uint8)
    parts = stripes(nbytes, len(sources))
    outcomes = await asyncio.gather(*(_stripe(source, part, buffer, timeout, max_nbytes)
                                      for source, part in zip(sources, parts, strict=True)), return_exceptions=True)
    manifests = [o for o in outcomes if isinstance(o, Manifest)]
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, Manifest):
            continue
        if not isinstance(outcome, WeightTransferError):
            raise outcome  # a bug, not a holder's failure
        manifests.append(await _again(sources, outcomes, index, parts[index], buffer, timeout, max_nbytes))
    manifest = manifests[0]
    if any(m.to_json() != manifest.to_json() for m in manifests[1:]):
        raise WeightIntegrityError("holders of one version sent different manifests")
    await asyncio.to_thread(verify, manifest, buffer, int(first["version"]), str(first["checksum"]))
    return Bundle(manifest=manifest, buffer=buffer)


def fetch_striped_sync(sources: Sequence[dict[str, Any]], timeout: float = 60.0,
                       max_nbytes: int = DEFAULT_MAX_NBYTES) -> Bundle:
    """Blocking ``fetch_striped`` (from a thread with no running event loop)."""
    return asyncio.run(fetch_striped(sources, timeout, max_nbytes))


async def _stripe(source: dict[str, Any], part: tuple[int, int], buffer: Buffer, timeout: float,
                  max_nbytes: int) -> Manifest:
    manifest, received = await receive_raw({**source, "range": list(part)}, timeout, max_nbytes, out=buffer)
    if received is not buffer:
        raise WeightTransferError(f"holder at {source.get('host')}:{source.get('port')} announced "
                                  f"{manifest.nbytes} bytes, the source says {buffer.nbytes}")
    return manifest


async def _again(sources: Sequence[dict[str, Any]], outcomes: list[Any], index: int, part: tuple[int, int],
                 buffer: Buffer, timeout: float, max_nbytes: int) -> Manifest:
    """A failed stripe from the holders that delivered theirs, one after another."""
    failed = sources[index]
    for source, outcome in zip(sources, outcomes, strict=True):
        if not isinstance(outcome, Manifest):
            continue
        try:
            return await _stripe(source, part, buffer, timeout, max_nbytes)
        except WeightTransferError:
            continue
    raise StripeError(f"bytes [{part[0]}, {part[1]}] from {failed.get('host')}:{failed.get('port')} failed "
                      f"({outcomes[index]}) and no other holder could serve them", failed)
