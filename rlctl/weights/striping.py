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
import time
from collections.abc import Sequence
from typing import Any

from rlctl.weights.bundle import ALIGNMENT, Buffer, Bundle, verify
from rlctl.weights.client import Received, receive
from rlctl.weights.errors import WeightIntegrityError, WeightTransferError
from rlctl.weights.lanes import combine
from rlctl.weights.staging import HostBuffer, HostBufferPool, allocate_host
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
                        max_nbytes: int = DEFAULT_MAX_NBYTES, pool: HostBufferPool | None = None) -> Bundle:
    """One version from every holder in ``sources`` at once, a stripe each, verified as a whole,
    into a buffer of ``pool`` when given (held while the bundle lives). Its ``pull`` names every
    holder's lanes and the slowest lane class."""
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
    if pool is None:
        return await _fetch_stripes(sources, allocate_host(nbytes, pin=False), timeout, max_nbytes)
    with pool.reserve(nbytes) as host:
        return await _fetch_stripes(sources, host, timeout, max_nbytes)


async def _fetch_stripes(sources: Sequence[dict[str, Any]], host: HostBuffer, timeout: float,
                         max_nbytes: int) -> Bundle:
    first = sources[0]
    buffer: Buffer = host.view(int(first["nbytes"]))
    parts = stripes(buffer.nbytes, len(sources))
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(_stripe(source, part, buffer, timeout, max_nbytes)
                                      for source, part in zip(sources, parts, strict=True)), return_exceptions=True)
    received = [o for o in outcomes if isinstance(o, Received)]
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, Received):
            continue
        if not isinstance(outcome, WeightTransferError):
            raise outcome  # a bug, not a holder's failure
        received.append(await _again(sources, outcomes, index, parts[index], buffer, timeout, max_nbytes))
    seconds = time.perf_counter() - started
    manifest = received[0].manifest
    if any(r.manifest.to_json() != manifest.to_json() for r in received[1:]):
        raise WeightIntegrityError("holders of one version sent different manifests")
    await asyncio.to_thread(verify, manifest, buffer, int(first["version"]), str(first["checksum"]))
    stats = combine([r.stats() for r in received], buffer.nbytes, seconds)
    bundle = Bundle(manifest=manifest, buffer=buffer, pull=stats)
    host.hold(bundle)
    return bundle



def fetch_striped_sync(sources: Sequence[dict[str, Any]], timeout: float = 60.0,
                       max_nbytes: int = DEFAULT_MAX_NBYTES, pool: HostBufferPool | None = None) -> Bundle:
    """Blocking ``fetch_striped`` (from a thread with no running event loop)."""
    return asyncio.run(fetch_striped(sources, timeout, max_nbytes, pool))


async def _stripe(source: dict[str, Any], part: tuple[int, int], buffer: Buffer, timeout: float,
                  max_nbytes: int) -> Received:
    received = await receive({**source, "range": list(part)}, timeout, max_nbytes, out=buffer)
    if received.buffer is not buffer:
        raise WeightTransferError(f"holder at {source.get('host')}:{source.get('port')} announced "
                                  f"{received.manifest.nbytes} bytes, the source says {buffer.nbytes}")
    return received


async def _again(sources: Sequence[dict[str, Any]], outcomes: list[Any], index: int, part: tuple[int, int],
                 buffer: Buffer, timeout: float, max_nbytes: int) -> Received:
    """A failed stripe from the holders that delivered theirs, one after another."""
    failed = sources[index]
    for source, outcome in zip(sources, outcomes, strict=True):
        if not isinstance(outcome, Received):
            continue
        try:
            return await _stripe(source, part, buffer, timeout, max_nbytes)
        except WeightTransferError:
            continue
    raise StripeError(f"bytes [{part[0]}, {part[1]}] from {failed.get('host')}:{failed.get('port')} failed "
                      f"({outcomes[index]}) and no other holder could serve them", failed)
