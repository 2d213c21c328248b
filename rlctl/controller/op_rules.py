"""What every data op shares: the refusal error, the wait a worker is told, and who may call what.

Role: the small rules both op parts (``DataOps``, ``EnvOps``) apply, kept apart so neither imports
the other.
"""

from __future__ import annotations

from rlctl.core.model import SlotRecord
from rlctl.core.states import WorkerState

WAIT_S = 0.2


class OpError(ValueError):
    """A request the controller refuses (unknown op, wrong role, bad arguments)."""


def takes_work(slot: SlotRecord) -> bool:
    """A worker being stopped, failed or gone gets no new work: its work was released when the
    recovery stopped it, and any given now would stay in flight with a wid nobody holds."""
    return slot.life is None or slot.life.state not in (WorkerState.STOPPING, WorkerState.FAILED, WorkerState.EXITED)


def require_role(slot: SlotRecord, *roles: str) -> None:
    if slot.role not in roles:
        raise OpError(f"{slot.slot} is a {slot.role} worker, not a {' or '.join(roles)} worker")
