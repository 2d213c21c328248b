"""GPU providers: one interface over real NVML, a simulator, and "no GPU".

A provider answers three questions for the agent:
- ``facts()``: what GPUs the node has (sent once, in ``hello``);
- ``sample()``: their current utilisation, memory, temperature, power, ECC, remap and throttle
  state (carried by every heartbeat);
- ``poll_events(timeout_ms)``: fault signals (XID, ECC, remap, throttle, GPU lost) that happened
  since the last call. It may block up to ``timeout_ms``; the agent calls it from a thread.

``NvmlProvider`` uses nvidia-ml-py (module ``pynvml``) and is only imported when available.
``SimProvider`` makes plausible numbers from the phases of the node's workers and raises faults
on request (the ``xid``/``ecc`` injections). ``make_gpu_provider`` picks one and never raises
for a missing driver: "auto" and "nvml" fall back to ``NoGpuProvider`` with the reason in facts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .signals import Signal, make_signal

log = logging.getLogger("rlctl_agent.gpu")

GpuSample = dict[str, Any]

XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double bit ECC error",
    63: "ECC page retirement or row remapping recording event (remap pending)",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
XID_GPU_LOST = 79
XID_REMAP_PENDING = 63
XID_REMAP_FAILURE = 64

# Clock-event reason bits that mean the hardware or driver slowed the GPU down
# (nvmlClocksEventReason*: SwThermal 0x20, HwSlowdown 0x8, HwThermal 0x40, HwPowerBrake 0x80).
THROTTLE_FAULT_BITS = 0x8 | 0x20 | 0x40 | 0x80


def xid_message(code: int) -> str:
    """A short human description of an XID code."""
    return f"XID {code}: {XID_MEANINGS.get(code, 'unlisted XID')}"


class GpuProvider(Protocol):
    """What the agent needs from a GPU source. ``poll_events`` may block; the rest must not."""

    name: str

    def facts(self) -> dict[str, Any]: ...

    def sample(self) -> list[GpuSample]: ...

    def poll_events(self, timeout_ms: int) -> list[Signal]: ...

    def close(self) -> None: ...


class NoGpuError(Exception):
    """NVML cannot be used on this node (no library, no driver, no permission)."""


class NoGpuProvider:
    """A node without GPUs (or with GPU monitoring turned off). ``status`` says why."""

    name = "none"

    def __init__(self, status: str) -> None:
        self.status = status
        self._closed = threading.Event()

    def facts(self) -> dict[str, Any]:
        return {"gpu_provider": self.name, "gpus": [], "gpu_status": self.status}

    def sample(self) -> list[GpuSample]:
        return []

    def poll_events(self, timeout_ms: int) -> list[Signal]:
        self._closed.wait(timeout_ms / 1000)
        return []

    def close(self) -> None:
        self._closed.set()


# --------------------------------------------------------------------------------------------
# Simulated GPUs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerLoad:
    """What a worker is doing, as seen by the simulated GPU it runs on."""

    gpu: int
    phase: str
    running: bool


# phase -> (SM utilisation %, fraction of GPU memory in use while in that phase)
PHASE_LOAD: dict[str, tuple[float, float]] = {
    "starting": (0.0, 0.0),
    "compiling": (15.0, 0.05),
    "loading": (8.0, 0.45),
    "waiting-for-work": (1.0, 0.55),
    "generating": (88.0, 0.88),
    "scoring": (60.0, 0.62),
    "waiting-for-batch": (1.0, 0.55),
    "training": (96.0, 0.92),
    "weight-sync": (25.0, 0.70),
    "checkpointing": (4.0, 0.60),
    "idle": (0.0, 0.55),
}
SIM_MEMORY_TOTAL = 80 * 1024**3
SIM_IDLE_POWER_W = 75.0
SIM_MAX_POWER_W = 700.0


@dataclass
class _SimGpu:
    index: int
    temp_c: float = 32.0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    lost: bool = False


class SimProvider:
    """N simulated H100-like GPUs whose load follows the phases of the node's workers.

    Each worker's load lands on the GPU the supervisor assigned it. Faults are raised with ``raise_xid``, ``raise_ecc``
    and ``set_remap``; XID 79 makes the GPU lost for good (samples say so, ``gpu-lost`` fires).
    Thread-safe: the agent samples from its event loop and polls events from a thread.
    """

    name = "sim"

    def __init__(self, node: str, count: int, load_source: Callable[[], list[WorkerLoad]]) -> None:
        self._node = node
        self._gpus = [_SimGpu(index) for index in range(count)]
        self._load_source = load_source
        self._lock = threading.Lock()
        self._pending: list[Signal] = []
        self._wakeup = threading.Condition(self._lock)
        self._rng = random.Random(zlib.crc32(node.encode()))

    def facts(self) -> dict[str, Any]:
        gpus = [{"index": gpu.index, "name": "Simulated NVIDIA H100 80GB HBM3",
                 "uuid": f"GPU-sim-{self._node}-{gpu.index:02d}", "memory_total": SIM_MEMORY_TOTAL}
                for gpu in self._gpus]
        return {"gpu_provider": self.name, "gpus": gpus, "gpu_status": f"{len(gpus)} simulated GPUs"}

    def sample(self) -> list[GpuSample]:
        loads = self._load_source()
        with self._lock:
            return [self._sample_one(gpu, [w for w in loads if w.gpu == gpu.index])
                    for gpu in self._gpus]

    def _sample_one(self, gpu: _SimGpu, loads: list[WorkerLoad]) -> GpuSample:
        if gpu.lost:
            return lost_sample(gpu.index)
        util, mem_fraction = 0.0, 0.0
        for load in loads:
            phase_util, phase_mem = PHASE_LOAD.get(load.phase, (0.0, 0.0))
            util = max(util, phase_util if load.running else 0.0)
            mem_fraction = min(0.97, mem_fraction + phase_mem)
        if util > 0:
            util = min(100.0, max(0.0, util + self._rng.uniform(-4, 4)))
        gpu.temp_c += (32.0 + 0.45 * util - gpu.temp_c) * 0.3
        return {
            "index": gpu.index, "util": round(util), "mem_used": int(mem_fraction * SIM_MEMORY_TOTAL),
            "mem_total": SIM_MEMORY_TOTAL, "temp_c": round(gpu.temp_c),
            "power_w": round(SIM_IDLE_POWER_W + (SIM_MAX_POWER_W - SIM_IDLE_POWER_W) * util / 100, 1),
            "ecc_sbe": gpu.ecc_sbe, "ecc_dbe": gpu.ecc_dbe, "throttle_reasons": 0,
            "remap_pending": gpu.remap_pending, "remap_failure": gpu.remap_failure, "lost": False,
        }

    def poll_events(self, timeout_ms: int) -> list[Signal]:
        with self._wakeup:
            if not self._pending:
                self._wakeup.wait(timeout_ms / 1000)
            signals, self._pending = self._pending, []
        return signals

    def close(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def raise_xid(self, gpu: int, code: int) -> None:
        """Make GPU ``gpu`` report XID ``code`` (with its side effects: 63/64 remap, 79 lost)."""
        with self._wakeup:
            target = self._usable(gpu)
            self._emit(make_signal("xid", gpu, xid_message(code), code=code))
            if code == XID_REMAP_PENDING:
                target.remap_pending = True
                self._emit(make_signal("remap-pending", gpu, "row remapping pending: reset the GPU"))
            elif code == XID_REMAP_FAILURE:
                target.remap_failure = True
                self._emit(make_signal("remap-failure", gpu, "row remapping failed: drain and RMA"))
            elif code == XID_GPU_LOST:
                target.lost = True
                self._emit(make_signal("gpu-lost", gpu, "GPU has fallen off the bus", code=code))

    def raise_ecc(self, gpu: int, kind: str) -> None:
        """Count one volatile ECC error of ``kind`` ("sbe" or "dbe") on GPU ``gpu``."""
        if kind not in ("sbe", "dbe"):
            raise ValueError(f"ECC kind must be 'sbe' or 'dbe', not {kind!r}")
        with self._wakeup:
            target = self._usable(gpu)
            if kind == "sbe":
                target.ecc_sbe += 1
                self._emit(make_signal("ecc-sbe", gpu, f"single bit ECC error (volatile total {target.ecc_sbe})"))
            else:
                target.ecc_dbe += 1
                self._emit(make_signal("ecc-dbe", gpu, f"double bit ECC error (volatile total {target.ecc_dbe})"))

    def set_remap(self, gpu: int, state: str) -> None:
        """Mark row remapping on GPU ``gpu`` as "pending" or "failure"."""
        if state not in ("pending", "failure"):
            raise ValueError(f"remap state must be 'pending' or 'failure', not {state!r}")
        with self._wakeup:
            target = self._usable(gpu)
            if state == "pending":
                target.remap_pending = True
            else:
                target.remap_failure = True
            self._emit(make_signal(f"remap-{state}", gpu, f"row remapping {state}"))

    def _usable(self, gpu: int) -> _SimGpu:
        if not 0 <= gpu < len(self._gpus):
            raise ValueError(f"no GPU {gpu} on this node ({len(self._gpus)} simulated GPUs)")
        target = self._gpus[gpu]
        if target.lost:
            raise ValueError(f"GPU {gpu} is lost (fell off the bus)")
        return target

    def _emit(self, signal: Signal) -> None:
        self._pending.append(signal)
        self._wakeup.notify_all()


def lost_sample(index: int) -> GpuSample:
    """The sample of a GPU that no longer answers."""
    return {"index": index, "util": None, "mem_used": None, "mem_total": None, "temp_c": None,
            "power_w": None, "ecc_sbe": None, "ecc_dbe": None, "throttle_reasons": None,
            "remap_pending": None, "remap_failure": None, "lost": True}


# --------------------------------------------------------------------------------------------
# Real NVML
# --------------------------------------------------------------------------------------------

class NvmlProvider:
    """Real GPUs through NVML (nvidia-ml-py). Construct with ``NvmlProvider.open()``.

    XID and ECC events come from an NVML event set (``nvmlEventSetWait_v2``, a timeout is not an
    error); remap and throttle signals are raised on the rising edge of sampled state; any
    ``NVML_ERROR_GPU_IS_LOST`` marks the GPU lost and raises ``gpu-lost`` once.
    """

    name = "nvml"

    def __init__(self, nvml: Any, handles: list[Any], static: list[dict[str, Any]]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._static = static
        self._lock = threading.Lock()
        self._pending: list[Signal] = []
        self._lost: set[int] = set()
        self._last: dict[int, tuple[bool, bool, int]] = {}
        self._event_set = self._register_events()

    @classmethod
    def open(cls) -> NvmlProvider:
        """Initialise NVML and enumerate GPUs; raise NoGpuError when NVML cannot be used."""
        try:
            import pynvml
        except ImportError:
            raise NoGpuError("no GPU: nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpuError(f"no GPU: NVML unavailable ({exc})") from None
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            static = [_static_facts(pynvml, i, handle) for i, handle in enumerate(handles)]
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise NoGpuError(f"no GPU: NVML could not enumerate devices ({exc})") from None
        return cls(pynvml, handles, static)

    def _register_events(self) -> Any:
        nvml = self._nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError | nvml.nvmlEventTypeSingleBitEccError
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML events unavailable: %s", exc)
            return None
        for index, handle in enumerate(self._handles):
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, event_set)
            except nvml.NVMLError as exc:
                log.warning("GPU %d: cannot register NVML events: %s", index, exc)
        return event_set

    def facts(self) -> dict[str, Any]:
        return {"gpu_provider": self.name, "gpus": list(self._static),
                "gpu_status": f"{len(self._static)} GPUs via NVML"}

    def sample(self) -> list[GpuSample]:
        return [self._sample_one(index, handle) for index, handle in enumerate(self._handles)]

    def _sample_one(self, index: int, handle: Any) -> GpuSample:
        if index in self._lost:
            return lost_sample(index)
        nvml = self._nvml
        try:
            sample = self._read_sample(index, handle)
        except nvml.NVMLError_GpuIsLost:
            self._mark_lost(index, "NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST)")
            return lost_sample(index)
        self._raise_edges(index, sample)
        return sample

    def _read_sample(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        util = self._optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        memory = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = self._optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        remap = self._optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        return {
            "index": index, "util": util,
            "mem_used": memory.used if memory is not None else None,
            "mem_total": memory.total if memory is not None else None,
            "temp_c": self._optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "power_w": round(power_mw / 1000, 1) if power_mw is not None else None,
            "ecc_sbe": self._optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)),
            "ecc_dbe": self._optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
            "throttle_reasons": self._optional(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
            "remap_pending": bool(remap[2]) if remap is not None else None,
            "remap_failure": bool(remap[3]) if remap is not None else None,
            "lost": False,
        }

    def _optional(self, read: Callable[[], Any]) -> Any:
        """Run one NVML query; None where the GPU does not support it. GPU-lost propagates."""
        nvml = self._nvml
        try:
            return read()
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError:
            return None

    def _raise_edges(self, index: int, sample: GpuSample) -> None:
        pending, failure = bool(sample["remap_pending"]), bool(sample["remap_failure"])
        throttle = (sample["throttle_reasons"] or 0) & THROTTLE_FAULT_BITS
        was_pending, was_failure, was_throttle = self._last.get(index, (False, False, 0))
        self._last[index] = (pending, failure, throttle)
        signals = []
        if pending and not was_pending:
            signals.append(make_signal("remap-pending", index, "row remapping pending: reset the GPU"))
        if failure and not was_failure:
            signals.append(make_signal("remap-failure", index, "row remapping failed: drain and RMA"))
        if throttle & ~was_throttle:
            signals.append(make_signal("throttle", index, f"clocks slowed, reasons 0x{throttle:x}", code=throttle))
        with self._lock:
            self._pending.extend(signals)

    def _mark_lost(self, index: int | None, message: str) -> None:
        with self._lock:
            if index is not None and index in self._lost:
                return
            if index is not None:
                self._lost.add(index)
            self._pending.append(make_signal("gpu-lost", index, message, code=XID_GPU_LOST))

    def poll_events(self, timeout_ms: int) -> list[Signal]:
        if self._event_set is None:
            time.sleep(timeout_ms / 1000)
        else:
            self._wait_event(timeout_ms)
        with self._lock:
            signals, self._pending = self._pending, []
        return signals

    def _wait_event(self, timeout_ms: int) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nvml.NVMLError_Timeout:
            return
        except nvml.NVMLError_GpuIsLost:
            self._mark_lost(None, "NVML event wait: a GPU has fallen off the bus")
            return
        except nvml.NVMLError as exc:
            log.warning("NVML event wait failed: %s", exc)
            time.sleep(timeout_ms / 1000)
            return
        self._on_event(data)

    def _on_event(self, data: Any) -> None:
        nvml = self._nvml
        try:
            index = nvml.nvmlDeviceGetIndex(data.device)
        except nvml.NVMLError:
            index = None
        if data.eventType & nvml.nvmlEventTypeXidCriticalError:
            code = int(data.eventData)
            with self._lock:
                self._pending.append(make_signal("xid", index, xid_message(code), code=code))
            if code == XID_GPU_LOST:
                self._mark_lost(index, xid_message(code))
        elif data.eventType & nvml.nvmlEventTypeDoubleBitEccError:
            with self._lock:
                self._pending.append(make_signal("ecc-dbe", index, "double bit ECC error"))
        elif data.eventType & nvml.nvmlEventTypeSingleBitEccError:
            with self._lock:
                self._pending.append(make_signal("ecc-sbe", index, "single bit ECC error"))

    def close(self) -> None:
        nvml = self._nvml
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("NVML shutdown: %s", exc)


def _static_facts(nvml: Any, index: int, handle: Any) -> dict[str, Any]:
    name = nvml.nvmlDeviceGetName(handle)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else name,
        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
        "memory_total": nvml.nvmlDeviceGetMemoryInfo(handle).total,
    }


def make_gpu_provider(kind: str, node: str, sim_gpus: int,
                      load_source: Callable[[], list[WorkerLoad]]) -> GpuProvider:
    """The provider for config value ``kind``; a node without a usable driver gets NoGpuProvider."""
    if kind == "sim":
        return SimProvider(node, sim_gpus, load_source)
    if kind == "none":
        return NoGpuProvider("no GPU: GPU monitoring disabled by configuration")
    try:
        return NvmlProvider.open()
    except NoGpuError as exc:
        if kind == "nvml":
            log.error("gpu_provider is 'nvml' but %s; reporting no GPUs", exc)
        else:
            log.info("%s; reporting no GPUs", exc)
        return NoGpuProvider(str(exc))
