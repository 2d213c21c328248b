"""A process group's store held by the process that starts its ranks on this machine.

Picking a "free" port (bind to 0, close, hand the number to the ranks) races with every other
process on the machine: between the close and rank 0's bind, any outgoing connection may be given
that ephemeral port, and rank 0 then fails with EADDRINUSE. Here the launcher binds the store
itself and keeps it for as long as the ranks run; the ranks join it as clients, the way torchrun's
agent does (``TORCHELASTIC_USE_AGENT_STORE``), so no port is ever left unowned.

Used by the GPU check's trainer-group parts and by the tests that start ranks by hand. A job's
trainers meet at the controller's fixed per-job port instead (``trainer_rendezvous_port``): their
group outlives any one launcher.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

LOOPBACK = "127.0.0.1"


@contextmanager
def held_store(timeout_s: float = 300.0) -> Iterator[dict[str, str]]:
    """Bind a TCPStore on loopback for the life of the block; yield the env its ranks need
    (``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE``), to be merged with
    ``WORLD_SIZE`` and ``RANK``."""
    from torch.distributed import TCPStore

    store = TCPStore(LOOPBACK, 0, None, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store
