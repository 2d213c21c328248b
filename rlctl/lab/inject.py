"""Backend-level faults on lab nodes: what ``SshBackend.inject``/``SlurmBackend.inject`` do when the
job's ``[cluster.*] lab_dir`` names an ``rlctl lab``.

The controller names faults ``partition``, ``node-down`` and ``slow-link`` (``rlctl inject-fault``);
the lab's own helpers are ``partition``/``heal``, ``node-down``/``node-up`` and ``slow``/``heal``.
A ``duration`` parameter undoes the fault after that many seconds (a timer held by the injector,
cancelled by :meth:`LabFaultInjector.close`). The lab's own names are accepted too, so tools and
tests can repair what they broke through the same backend.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from rlctl.lab.cluster import FAULT_KINDS, apply_fault

log = logging.getLogger(__name__)

#: Faults a backend with a lab dir can carry out for the controller (``supported_faults``).
BACKEND_FAULT_KINDS = frozenset({"partition", "node-down", "slow-link"})
DEFAULT_DELAY_MS = 100
# controller fault -> (lab fault, lab fault that undoes it)
_LAB_FAULT = {
    "partition": ("partition", "heal"),
    "node-down": ("node-down", "node-up"),
    "slow-link": ("slow", "heal"),
}


class LabFaultInjector:
    """Carries out faults on the nodes of the lab in ``state_dir``. Async; blocking work in threads."""

    supported_faults = BACKEND_FAULT_KINDS

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._timers: set[asyncio.Task[None]] = set()

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> bool:
        """Apply ``kind`` to ``node``; False for a kind the lab does not know. Raises LabError
        (naming the node) when the lab cannot do it."""
        if kind in _LAB_FAULT:
            lab_kind, undo = _LAB_FAULT[kind]
        elif kind in FAULT_KINDS:
            lab_kind, undo = kind, None
        else:
            return False
        lab_params = dict(params)
        if lab_kind == "slow":
            lab_params["delay_ms"] = int(params.get("delay_ms") or DEFAULT_DELAY_MS)
        await asyncio.to_thread(apply_fault, node, lab_kind, lab_params, state_dir=self.state_dir)
        log.info("lab fault %s on %s (%s)", kind, node, lab_params or "no params")
        duration = float(params.get("duration") or 0.0)
        if undo is not None and duration > 0:
            task = asyncio.get_running_loop().create_task(self._undo_after(node, undo, duration))
            self._timers.add(task)
            task.add_done_callback(self._timers.discard)
        return True

    async def _undo_after(self, node: str, undo: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        try:
            await asyncio.to_thread(apply_fault, node, undo, {}, state_dir=self.state_dir)
            log.info("lab fault on %s undone (%s) after %.1fs", node, undo, delay_s)
        except Exception as exc:  # noqa: BLE001  # a timer must not die silently: say which node stays broken
            log.warning("could not %s %s after %.1fs: %s", undo, node, delay_s, exc)

    async def close(self) -> None:
        """Cancel pending undo timers (their faults stay in place: `rlctl.lab.heal`/`node_up` repair a node)."""
        for task in list(self._timers):
            task.cancel()
        self._timers.clear()
