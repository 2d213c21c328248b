"""Which lane a weight pull took, how fast it went, and whether a faster one was there.

Role: the record each pull carries (``PullStats``: the lanes, the lane class, bytes, seconds,
GB/s), and the facts behind it:

* ``endpoint_lanes``: the UCX transports an endpoint uses, read from UCX itself with
  ``ucp_ep_query(UCP_EP_ATTR_FIELD_TRANSPORTS)`` through ctypes (ucxx 0.52 does not expose it),
  as ``"transport/device"`` strings (``"cma/memory"``, ``"tcp/lo"``, ``"rc_mlx5/mlx5_0:1"``).
  The connection manager's lane (``tcp`` with no device) carries no data and is left out.
* ``lane_class``: those lanes as one label from a fixed set (``LANE_CLASSES``), the fastest
  that can carry the memory moved: ``self`` (same process), ``cuda_ipc`` (GPU memory only),
  ``sm`` (posix, sysv, cma, xpmem, knem, and ``memfd``: rlctl's own same-node path,
  ``transport_shm``), ``rdma`` (rc, dc, ud), ``tcp``. rlctl's transfers move host memory, so an
  endpoint's CUDA lanes (which UCX adds on a GPU node whatever the buffer) do not count for
  them. rlctl's own ``tcp`` transport is lane ``tcp``.
* ``local_node_id``: this machine as seen from its network namespace (hostname, boot id and the
  namespace), which a holder puts in its descriptor so that a joiner knows it is on the same node.
* ``faster_lane``: the lane a pull could have taken: ``sm`` for a same-node pull that went over
  tcp (rlctl's memory files are there on Linux, UCX shared memory whenever ucxx is), ``rdma``
  for a cross-node tcp pull on a node with RDMA devices (``/sys/class/infiniband``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import socket
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LANE_CLASSES = ("self", "cuda_ipc", "sm", "rdma", "tcp", "other")  # fastest first
TCP_SOCKET_LANE = "tcp/socket"  # rlctl's own tcp transport: kernel sockets, no UCX
SHARED_MEMORY = frozenset({"posix", "sysv", "cma", "xpmem", "knem", "memfd"})  # memfd: rlctl's transport_shm
MEMORY_HELPERS = frozenset({"cuda_copy", "rocm_copy", "gdr_copy"})  # copy within one process's memory types
DEVICE_ONLY = frozenset({"cuda_ipc", "rocm_ipc"})  # carry GPU memory between processes, never host memory
RDMA_PREFIXES = ("rc", "dc", "ud")
UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
MAX_LANES = 32
RDMA_DEVICES = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class Route:
    """How one transfer went: the rlctl transport taken and the lanes under it."""

    transport: str
    lanes: tuple[str, ...]
    device_memory: bool = False  # the bytes landed in GPU memory (then cuda_ipc counts)
    landed_checksum: str | None = None  # the checksum of the bytes as they landed, where the receiver made it

    @property
    def lane(self) -> str:
        return lane_class(self.lanes, self.device_memory)


@dataclass(frozen=True)
class PullStats:
    """One pull of a weights version: the path taken (``transport``: what the joiner actually used,
    ``ucx-sm`` for a ``ucx`` holder on the same node), the lanes (every holder's, for a striped or
    sharded pull), the lane class that bounded it (the slowest of its transfers), bytes and
    seconds (connect to last byte, before verification), from how many holders, and whether every
    holder was on this node."""

    transport: str
    lane: str
    lanes: tuple[str, ...]
    nbytes: int
    seconds: float
    holders: int
    same_node: bool

    @property
    def gbps(self) -> float:
        return float(f"{self.nbytes / self.seconds / 1e9:.4g}") if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"transport": self.transport, "lane": self.lane, "lanes": list(self.lanes), "bytes": self.nbytes,
                "seconds": round(self.seconds, 6), "gbps": self.gbps, "holders": self.holders,
                "same_node": self.same_node}


def lane_class(lanes: Iterable[str], device_memory: bool = False) -> str:
    """The fastest class among ``lanes`` (``"transport/device"``) that can carry the memory moved
    (host memory unless ``device_memory``); ``tcp`` when there are none."""
    classes = {_class_of(lane.split("/", 1)[0]) for lane in lanes
               if device_memory or lane.split("/", 1)[0] not in DEVICE_ONLY}
    classes.discard("")
    for name in LANE_CLASSES:
        if name in classes:
            return name
    return "tcp"


def _class_of(transport: str) -> str:
    if transport in MEMORY_HELPERS:
        return ""
    if transport in ("self", "cuda_ipc", "tcp"):
        return transport
    if transport in SHARED_MEMORY:
        return "sm"
    if transport.startswith(RDMA_PREFIXES):
        return "rdma"
    return "other"


def slowest(classes: Sequence[str]) -> str:
    """The slowest of several transfers' lane classes (what bounds a pull made of them)."""
    return max(classes, key=lambda c: LANE_CLASSES.index(c) if c in LANE_CLASSES else len(LANE_CLASSES))


def combine(stats: Sequence[PullStats], nbytes: int, seconds: float) -> PullStats:
    """One record for a pull made of several transfers (stripes, shards) of ``nbytes`` in ``seconds``."""
    lanes = tuple(sorted({lane for s in stats for lane in s.lanes}))
    transports = sorted({s.transport for s in stats})
    return PullStats(transport="+".join(transports), lane=slowest([s.lane for s in stats]), lanes=lanes,
                     nbytes=nbytes, seconds=seconds, holders=sum(s.holders for s in stats),
                     same_node=all(s.same_node for s in stats))


# ---------------------------------------------------------------------------------------------
# the machine


_node_id: str | None = None


def local_node_id() -> str:
    """A short id of this node: equal for two processes on one machine in one network namespace."""
    global _node_id
    if _node_id is None:
        parts = [socket.gethostname(), _read("/proc/sys/kernel/random/boot_id")]
        try:
            parts.append(os.readlink("/proc/self/ns/net"))
        except OSError:
            pass
        _node_id = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return _node_id


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def same_node(source: dict[str, Any]) -> bool:
    """Whether the holder named by ``source`` runs on this node (its descriptor's ``node_id``)."""
    return source.get("node_id") == local_node_id()


def rdma_devices() -> list[str]:
    """The RDMA devices of this node (empty where there are none)."""
    try:
        return sorted(p.name for p in RDMA_DEVICES.iterdir())
    except OSError:
        return []


def ucx_available() -> bool:
    """Whether ucxx can be imported here (checked without importing it)."""
    return importlib.util.find_spec("ucxx") is not None


def shared_memory_supported() -> bool:
    """Whether this platform has what rlctl's memory-file path needs (``transport_shm``): memory
    files and descriptor passing over Unix sockets."""
    return sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def faster_lane(stats: PullStats) -> str | None:
    """The lane class a pull that went over tcp could have taken on this node, or None."""
    if stats.lane != "tcp":
        return None
    if stats.same_node and (ucx_available() or shared_memory_supported()):
        return "sm"
    if not stats.same_node and rdma_devices():
        return "rdma"
    return None


# ---------------------------------------------------------------------------------------------
# UCX's own answer


class _TransportEntry(ctypes.Structure):
    """``ucp_transport_entry_t`` (ucp/api/ucp_def.h)."""

    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


def endpoint_lanes(endpoint: Any) -> tuple[str, ...]:
    """The data lanes of a ucxx endpoint as ``"transport/device"``, from ``ucp_ep_query``; empty
    where UCX cannot say (call on the UCX loop, while the endpoint is open)."""
    from rlctl.weights.ucx_guard import _EpAttr, _query_function

    query = _query_function()
    if query is None:
        return ()
    entries = (_TransportEntry * MAX_LANES)()
    attr = _EpAttr(field_mask=UCP_EP_ATTR_FIELD_TRANSPORTS)
    attr.transports.entries = ctypes.cast(entries, ctypes.c_void_p)
    attr.transports.num_entries = MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    try:
        if query(ctypes.c_void_p(int(endpoint.ucp_endpoint)), ctypes.byref(attr)) != 0:
            return ()
    except Exception:  # noqa: BLE001 - a closed endpoint: no lanes to report
        return ()
    lanes = []
    for entry in entries[:min(int(attr.transports.num_entries), MAX_LANES)]:
        transport = (entry.transport_name or b"").decode(errors="replace")
        device = (entry.device_name or b"").decode(errors="replace")
        if transport and device:  # no device: the connection manager's lane
            lanes.append(f"{transport}/{device}")
    return tuple(dict.fromkeys(lanes))
