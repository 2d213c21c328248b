"""Joiner side: fetch a weights version from any holder named by a source descriptor.

Role: a rollout that joins (or falls behind), a restored trainer, or any worker told by the
controller to hold version `v` calls `fetch(source)` with the descriptor from the registry. The
transport is the one named in the descriptor; the received buffer is verified (version, size,
checksum) before anything is returned, and tensors are zero-copy views into it.

* `fetch` / `fetch_sync` → `(version, state_dict)`.
* `fetch_bundle` → the verified flat `Bundle`, which a holder can re-serve as is with
  `WeightServer.publish_bundle` (rollout → new rollout without re-packing).
* `receive_raw` → the unverified manifest and buffer (benchmarks, or callers that verify later).

Errors: `WeightTransferError` (holder gone, refused, timed out: try another holder),
`WeightIntegrityError` (the bytes are not what the descriptor promised: never use them),
`TransportUnavailableError` (e.g. a ucx descriptor in a process without ucxx),
`ValueError` for a malformed descriptor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rlctl.weights.bundle import Buffer, Bundle, Manifest, unflatten, verify
from rlctl.weights.transport_tcp import DEFAULT_MAX_NBYTES, tcp_receive

Receiver = Callable[[dict[str, Any], float, int, Buffer | None], Awaitable[tuple[Manifest, Buffer]]]
DESCRIPTOR_KEYS = ("transport", "host", "port", "version", "nbytes", "checksum")


def _receiver(transport: str) -> Receiver:
    if transport == "tcp":
        return tcp_receive
    if transport in ("ucx", "ucx-sm"):
        from rlctl.weights.transport_ucx import sm_receive, ucx_receive

        return ucx_receive if transport == "ucx" else sm_receive
    raise ValueError(f"source descriptor names an unknown transport {transport!r}")


def check_descriptor(source: dict[str, Any]) -> None:
    """Raise `ValueError` unless `source` has the fields and types of a source descriptor."""
    if not isinstance(source, dict):
        raise ValueError(f"source descriptor must be a dict, got {type(source).__name__}")  # noqa: TRY004
    missing = [key for key in DESCRIPTOR_KEYS if key not in source]
    if missing:
        raise ValueError(f"source descriptor lacks {missing}")
    if not isinstance(source["host"], str) or not isinstance(source["port"], int):
        raise ValueError("source descriptor host must be str and port int")  # noqa: TRY004
    if not isinstance(source["version"], int) or not isinstance(source["nbytes"], int):
        raise ValueError("source descriptor version and nbytes must be int")  # noqa: TRY004


async def receive_raw(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> tuple[Manifest, Buffer]:
    """Transfer the holder's manifest and flat buffer, unverified. `out` is used when its size fits."""
    check_descriptor(source)
    deadline = asyncio.get_running_loop().time() + timeout
    return await _receiver(source["transport"])(source, deadline, max_nbytes, out)


async def fetch_bundle(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                       out: Buffer | None = None) -> Bundle:
    """Transfer and verify (version, checksum against the descriptor, then of the bytes).

    `out`: a uint8 buffer to receive into when its size matches (else a fresh one is allocated).
    Reusing a host staging buffer avoids first-touch page faults, which cost more than the
    transfer itself on some machines; tensors from an earlier fetch into `out` are overwritten.
    """
    manifest, buffer = await receive_raw(source, timeout, max_nbytes, out)
    await asyncio.to_thread(verify, manifest, buffer, source["version"], source["checksum"])
    return Bundle(manifest=manifest, buffer=buffer)


async def fetch(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                out: Buffer | None = None) -> tuple[int, dict[str, Any]]:
    """Fetch weights from the holder in `source`: `(version, {name: tensor})`, tensors on CPU.

    `timeout` bounds the transfer (connect to last byte). Tensors are views into one buffer
    (`out` when given and of the right size, see `fetch_bundle`).
    """
    bundle = await fetch_bundle(source, timeout, max_nbytes, out)
    return bundle.manifest.version, unflatten(bundle.manifest, bundle.buffer)


def fetch_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
               out: Buffer | None = None) -> tuple[int, dict[str, Any]]:
    """Blocking `fetch` for synchronous code; must not be called from a thread running an event loop."""
    return asyncio.run(fetch(source, timeout, max_nbytes, out))


def fetch_bundle_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> Bundle:
    """Blocking `fetch_bundle` (same constraint as `fetch_sync`)."""
    return asyncio.run(fetch_bundle(source, timeout, max_nbytes, out))
