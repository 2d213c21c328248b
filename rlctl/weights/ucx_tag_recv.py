"""The ``ucx-sm`` joiner's worker-level tag receive, which UCX never writes through freed memory.

Role: a pull gives up while its receive is posted (its deadline, the holder's control connection
closing, the caller cancelling it: the standby drops copies that a newer version overtook). UCX
can cancel a receive no message has matched yet, but one already matched goes on: UCX's tcp lanes
write each fragment as it comes, and cancelling offers no way to stop it (measured here with a
holder stopped mid-transfer: about 460 MB landed after the pull had returned, once the holder went on;
with a holder killed mid-transfer, UCX never ends the receive). The old joiner dropped the
receive with its buffer, so those bytes could land in freed memory (a fresh buffer of a few MB
lies on the malloc heap: the heap corruption seen once in CI) or in a pooled buffer already
handed to the next pull.

So ``receive_tagged``, when its pull gives up before the receive ended:

* shuts the control connection, which tells a live holder to stop sending;
* sends a 1-byte message with the receive's tag from this worker to itself, which ends a
  receive no message has matched (the holder's, if it comes later, matches nothing: every pull
  draws a fresh 64-bit tag);
* waits ``ABANDON_GRACE_S`` for UCX to end a matched one;
* keeps a receive still running after that referenced with its buffer, and the pooled buffer
  it lands in (host or device) busy, until UCX ends it (``staging.keep_until_written``; never,
  when the holder died), with a warning: memory held, never memory corrupted.

torch-free and UCX-free at import: the runtime (``transport_ucx.UcxRuntime``) is passed in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from typing import Any, Protocol

import numpy as np

from rlctl.weights import framing
from rlctl.weights.errors import WeightTimeoutError, WeightTransferError
from rlctl.weights.staging import keep_until_written

log = logging.getLogger(__name__)

ABANDON_GRACE_S = 0.5


class TagRuntime(Protocol):
    """What ``receive_tagged`` needs of ``transport_ucx.UcxRuntime``."""

    ucxx: Any
    worker_address: bytes

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]: ...

    async def run(self, coro: Any) -> Any: ...


async def receive_tagged(runtime: TagRuntime, sock: socket.socket, buffer: Any, tag: int, deadline: float,
                         ucx_errors: tuple[type[BaseException], ...]) -> None:
    """Receive the message tagged ``tag`` into ``buffer`` on this process's worker by
    ``deadline``: ``WeightTransferError`` if the holder's control connection ``sock`` closes first
    or UCX fails it (``ucx_errors``), ``WeightTimeoutError`` at the deadline. However it ends, the
    caller may free or reuse ``buffer`` afterwards (see the module docstring). The caller keeps
    UCX progressed meanwhile (``UcxRuntime.kept_hot``): a receive kept after its pull must not
    keep a core busy."""
    receive = runtime.submit(runtime.ucxx.recv(buffer, tag=tag))
    holder_gone = asyncio.ensure_future(framing.wait_for_eof(sock))
    try:
        done, _ = await asyncio.wait({asyncio.shield(asyncio.wrap_future(receive)), holder_gone},
                                     timeout=framing.remaining(deadline), return_when=asyncio.FIRST_COMPLETED)
        if receive.done():
            try:
                receive.result()
            except ucx_errors as exc:
                raise WeightTransferError(f"UCX error while receiving the weights: {exc!r}") from exc
            return
        if holder_gone in done:
            raise WeightTransferError("holder closed the control connection before the weights arrived")
        raise WeightTimeoutError("timed out while receiving the weights")
    finally:
        holder_gone.cancel()
        await asyncio.gather(holder_gone, return_exceptions=True)
        if not receive.done():
            await _end_abandoned(runtime, sock, receive, tag, buffer)


async def _end_abandoned(runtime: TagRuntime, sock: socket.socket, receive: concurrent.futures.Future[Any],
                         tag: int, buffer: Any) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    try:
        await runtime.run(_send_to_self(runtime, tag))
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(receive)), ABANDON_GRACE_S)
    except BaseException as exc:  # noqa: BLE001 - the grace's end, UCX's own error, or the caller
        # cancelled again: the pull's own error goes on up in any case (this runs in its ``finally``)
        log.debug("ending the receive of a pull that gave up: %r", exc)
    if receive.done():
        return
    address = int(buffer.ctypes.data) if isinstance(buffer, np.ndarray) else int(buffer.data_ptr())  # a torch tensor
    keep_until_written(address, int(buffer.nbytes), receive)
    log.warning("a UCX receive of %d bytes from a pull that gave up is still running: its buffer is kept until "
                "UCX ends it (a holder that died mid-transfer never does)", int(buffer.nbytes))


async def _send_to_self(runtime: TagRuntime, tag: int) -> None:
    """One byte tagged ``tag`` from this worker to itself (UCX's ``self`` transport)."""
    ucxx = runtime.ucxx
    endpoint = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(runtime.worker_address), endpoint_error_handling=False)
    try:
        await endpoint.send(np.zeros(1, dtype=np.uint8), tag=tag, force_tag=True)
    finally:
        with contextlib.suppress(Exception):
            await endpoint.close()
