"""Versioned weight publication and point-to-point transfer between any two holders.

A holder runs a `WeightServer` (or `WeightServerThread` from synchronous code) and publishes
versions; each publish returns a source descriptor
`{transport, host, port, worker_address_hex?, version, nbytes, checksum}` for the controller's
registry. A joiner calls `fetch(source)` / `fetch_sync(source)` and gets `(version, state_dict)`,
verified. Transports: `ucx` (ucxx listener), `ucx-sm` (ucxx worker-address endpoint, shared
memory on one host; a `ucx` holder offers it to joiners on its node), `tcp` (stdlib fallback).
No collective group. Host buffers are reused and pinned where CUDA is (`staging`), checksums are
hashed leaf by leaf on several threads (`checksum`), and every pull says which lanes it took
(`lanes`). A `ucx` holder can also keep a version in device memory for joiners on GPUs to pull
device to device (`device_bundle`, `fetch_device_bundle`). See docs/weight-sync.md.
"""

from rlctl.weights.bundle import Bundle, Manifest, TensorEntry, compute_checksum, flatten, unflatten, verify
from rlctl.weights.client import (
    fetch,
    fetch_bundle,
    fetch_bundle_sync,
    fetch_device_bundle,
    fetch_device_bundle_sync,
    fetch_sync,
    offers_device_copy,
    receive_raw,
)
from rlctl.weights.errors import (
    TransportUnavailableError,
    WeightError,
    WeightIntegrityError,
    WeightTimeoutError,
    WeightTransferError,
    WeightVersionMovedError,
)
from rlctl.weights.server import TRANSPORTS, WeightServer, WeightServerThread, resolve_transport

__all__ = [
    "TRANSPORTS",
    "Bundle",
    "Manifest",
    "TensorEntry",
    "TransportUnavailableError",
    "WeightError",
    "WeightIntegrityError",
    "WeightServer",
    "WeightServerThread",
    "WeightTimeoutError",
    "WeightTransferError",
    "WeightVersionMovedError",
    "compute_checksum",
    "fetch",
    "fetch_bundle",
    "fetch_bundle_sync",
    "fetch_device_bundle",
    "fetch_device_bundle_sync",
    "fetch_sync",
    "flatten",
    "offers_device_copy",
    "receive_raw",
    "resolve_transport",
    "unflatten",
    "verify",
]
