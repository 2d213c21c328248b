"""Fault injection on the node: the agent side of ``rlctl inject-fault``.

Kinds (``inject {kind, params}``):
- ``crash``: SIGKILL the worker named by ``params.worker`` (all workers when absent);
- ``hang``: SIGSTOP it; with ``duration`` (s) SIGCONT it afterwards;
- ``slow``: SIGSTOP/SIGCONT duty cycle for ``duration`` s so it runs at 1/``factor`` speed;
- ``nccl-timeout``: the worker SDK command ``nccl-timeout`` (the worker prints the torch watchdog
  failure and aborts); the worker must be connected to the relay;
- ``xid`` (``code``, ``gpu``), ``ecc`` (``kind`` sbe|dbe, ``gpu``), ``remap`` (``state``
  pending|failure, ``gpu``): raised by the simulated GPU provider; refused on real GPUs;
- ``agent-kill``: the agent dies at once (SIGKILL), its workers stay;
- ``node-down``: every worker's process group is SIGKILLed, then the agent dies.
Every injection is acknowledged by the agent; the last two ask it to die after the ack.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from .gpu import GpuProvider, SimProvider
from .relay import WorkerRelay
from .supervisor import Supervisor, WorkerRecord

log = logging.getLogger("rlctl_agent.faults")

SLOW_PERIOD_S = 0.2
SLOW_DEFAULT_DURATION_S = 30.0
MAX_XID = 255


class FaultError(Exception):
    """The injection cannot be carried out here (unknown kind, worker or GPU; wrong provider)."""


@dataclass(frozen=True)
class InjectOutcome:
    """What an injection did, and whether the agent must die once it has acknowledged it."""

    detail: str
    agent_exit: bool = False


class FaultInjector:
    """Carries out injected faults against this node's workers and GPUs."""

    def __init__(self, supervisor: Supervisor, gpu: GpuProvider, relay: WorkerRelay) -> None:
        self._supervisor = supervisor
        self._gpu = gpu
        self._relay = relay
        self._tasks: set[asyncio.Task[None]] = set()

    async def inject(self, kind: str, params: dict[str, Any]) -> InjectOutcome:
        """Carry out fault ``kind``; raise FaultError when it cannot be done."""
        handlers = {
            "crash": self._crash, "hang": self._hang, "slow": self._slow, "nccl-timeout": self._nccl_timeout,
            "xid": self._xid, "ecc": self._ecc, "remap": self._remap,
            "agent-kill": self._agent_kill, "node-down": self._node_down,
        }
        handler = handlers.get(kind)
        if handler is None:
            raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(handlers))}")
        outcome = handler(params)
        log.warning("injected %s: %s", kind, outcome.detail)
        return outcome

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ---- worker faults ---------------------------------------------------------------------

    def _targets(self, params: dict[str, Any]) -> list[WorkerRecord]:
        wid = params.get("worker") or params.get("wid")
        if wid is None:
            targets = self._supervisor.live()
        else:
            record = self._supervisor.workers.get(str(wid))
            if record is None or record.exited:
                raise FaultError(f"no live worker {wid!r} on this node")
            targets = [record]
        if not targets:
            raise FaultError("no live workers on this node")
        return targets

    def _crash(self, params: dict[str, Any]) -> InjectOutcome:
        killed = [r.wid for r in self._targets(params) if self._supervisor.send_signal(r, signal.SIGKILL)]
        return InjectOutcome(f"SIGKILL sent to {', '.join(killed) or 'nobody'}")

    def _hang(self, params: dict[str, Any]) -> InjectOutcome:
        duration = _optional_positive(params, "duration")
        targets = self._targets(params)
        for record in targets:
            self._supervisor.send_signal(record, signal.SIGSTOP)
            if duration is not None:
                self._spawn(self._resume_after(record, duration))
        until = f" for {duration} s" if duration is not None else " until stopped"
        return InjectOutcome(f"SIGSTOP sent to {', '.join(r.wid for r in targets)}{until}")

    async def _resume_after(self, record: WorkerRecord, duration: float) -> None:
        await asyncio.sleep(duration)
        self._supervisor.send_signal(record, signal.SIGCONT)

    def _slow(self, params: dict[str, Any]) -> InjectOutcome:
        factor = _optional_positive(params, "factor") or 4.0
        if factor <= 1:
            raise FaultError("slow needs factor > 1")
        duration = _optional_positive(params, "duration") or SLOW_DEFAULT_DURATION_S
        targets = self._targets(params)
        for record in targets:
            self._spawn(self._duty_cycle(record, factor, duration))
        return InjectOutcome(f"{', '.join(r.wid for r in targets)} at 1/{factor:g} speed for {duration:g} s")

    async def _duty_cycle(self, record: WorkerRecord, factor: float, duration: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration
        run_s = SLOW_PERIOD_S / factor
        try:
            while loop.time() < deadline and not record.exited:
                if not self._supervisor.send_signal(record, signal.SIGSTOP):
                    return
                await asyncio.sleep(SLOW_PERIOD_S - run_s)
                self._supervisor.send_signal(record, signal.SIGCONT)
                await asyncio.sleep(run_s)
        finally:
            self._supervisor.send_signal(record, signal.SIGCONT)

    def _nccl_timeout(self, params: dict[str, Any]) -> InjectOutcome:
        targets = self._targets(params)
        command_params = {key: value for key, value in params.items() if key not in ("worker", "wid")}
        unreachable = [r.wid for r in targets if not self._relay.send_command(r.wid, "nccl-timeout", command_params)]
        if unreachable:
            raise FaultError(f"worker(s) {', '.join(unreachable)} are not connected through the worker SDK")
        return InjectOutcome(f"nccl-timeout command sent to {', '.join(r.wid for r in targets)}")

    # ---- GPU faults ------------------------------------------------------------------------

    def _sim(self, kind: str) -> SimProvider:
        if not isinstance(self._gpu, SimProvider):
            raise FaultError(f"{kind} injection needs gpu_provider 'sim'; this node uses {self._gpu.name!r}")
        return self._gpu

    def _xid(self, params: dict[str, Any]) -> InjectOutcome:
        sim = self._sim("xid")
        code, gpu = _required_int(params, "code"), _int(params, "gpu", 0)
        if not 1 <= code <= MAX_XID:
            raise FaultError(f"code must be an XID in [1, {MAX_XID}], got {code}")
        self._call_sim(lambda: sim.raise_xid(gpu, code))
        return InjectOutcome(f"XID {code} on GPU {gpu}")

    def _ecc(self, params: dict[str, Any]) -> InjectOutcome:
        sim = self._sim("ecc")
        kind, gpu = str(params.get("kind", "dbe")), _int(params, "gpu", 0)
        self._call_sim(lambda: sim.raise_ecc(gpu, kind))
        return InjectOutcome(f"ECC {kind} on GPU {gpu}")

    def _remap(self, params: dict[str, Any]) -> InjectOutcome:
        sim = self._sim("remap")
        state, gpu = str(params.get("state", "pending")), _int(params, "gpu", 0)
        self._call_sim(lambda: sim.set_remap(gpu, state))
        return InjectOutcome(f"row remap {state} on GPU {gpu}")

    @staticmethod
    def _call_sim(action: Callable[[], None]) -> None:
        try:
            action()
        except ValueError as exc:
            raise FaultError(str(exc)) from None

    # ---- node faults -----------------------------------------------------------------------

    def _agent_kill(self, params: dict[str, Any]) -> InjectOutcome:
        return InjectOutcome("agent exits now; workers keep running", agent_exit=True)

    def _node_down(self, params: dict[str, Any]) -> InjectOutcome:
        killed = [r.wid for r in self._supervisor.live() if self._supervisor.send_signal(r, signal.SIGKILL)]
        return InjectOutcome(f"SIGKILL sent to {', '.join(killed) or 'no workers'}; agent exits now",
                             agent_exit=True)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a fault's background task failed", exc_info=exc)


def _int(params: dict[str, Any], key: str, default: int) -> int:
    try:
        return int(params.get(key, default))
    except (TypeError, ValueError):
        raise FaultError(f"{key} must be an integer") from None


def _required_int(params: dict[str, Any], key: str) -> int:
    if key not in params:
        raise FaultError(f"missing parameter {key!r}")
    return _int(params, key, 0)


def _optional_positive(params: dict[str, Any], key: str) -> float | None:
    if params.get(key) is None:
        return None
    try:
        value = float(params[key])
    except (TypeError, ValueError):
        raise FaultError(f"{key} must be a number") from None
    if not math.isfinite(value) or value <= 0:
        raise FaultError(f"{key} must be a positive finite number, got {params[key]!r}")
    return value
