"""Lanes: the UCX transports a pull took, read from UCX itself, and the rule that names a faster one.

Real processes: a holder and joiners with ``UCX_TLS`` as the test sets it, so UCX chooses as it
would in a job. A ``ucx`` holder on the same node is pulled from over its shared-memory channel:
with ``sm`` allowed the lane is shared memory (``sm``); with only ``tcp`` allowed it is ``tcp``,
and a faster lane (``sm``) is named. Without the channel (``sm_port`` left out) the listener's
endpoint is used, which UCX runs on tcp.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from typing import Any

import pytest
import weights_procs

from rlctl.weights import lanes
from rlctl.weights.lanes import PullStats, combine, faster_lane, lane_class, local_node_id, slowest

CTX = mp.get_context("spawn")
needs_ucxx = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (the 'ucx' extra) is not installed")
WAIT_S = 90.0


def _stats(lane: str, same_node: bool) -> PullStats:
    return PullStats(transport="ucx", lane=lane, lanes=(), nbytes=10, seconds=1.0, holders=1, same_node=same_node)


def test_lane_classes_name_the_fastest_data_lane_and_a_pull_is_bounded_by_its_slowest_transfer() -> None:
    assert lane_class(["self/memory", "sysv/memory", "cma/memory"]) == "self"
    assert lane_class(["sysv/memory", "cma/memory"]) == "sm"
    assert lane_class(["tcp/lo"]) == "tcp" and lane_class([]) == "tcp"
    assert lane_class(["rc_mlx5/mlx5_0:1", "tcp/eth0"]) == "rdma"
    gpu_node = ["cuda_copy/cuda", "cuda_ipc/cuda", "posix/memory"]  # UCX_TLS=all between two processes of a GPU node
    assert lane_class(gpu_node) == "sm" and lane_class(gpu_node, device_memory=True) == "cuda_ipc"
    assert lane_class(["cuda_copy/cuda", "tcp/lo"]) == "tcp"  # a memory-type helper carries nothing between processes
    assert lane_class(["gni/x"]) == "other"
    assert slowest(["sm", "tcp", "rdma"]) == "tcp"
    pull = combine([_stats("sm", True), _stats("tcp", False)], 20, 2.0)
    assert (pull.lane, pull.nbytes, pull.holders, pull.same_node, pull.gbps) == ("tcp", 20, 2, False, 1e-8)


def test_a_faster_lane_is_named_only_for_a_tcp_pull_that_had_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanes, "ucx_available", lambda: True)
    monkeypatch.setattr(lanes, "rdma_devices", list)
    assert faster_lane(_stats("tcp", same_node=True)) == "sm"
    assert faster_lane(_stats("sm", same_node=True)) is None
    assert faster_lane(_stats("tcp", same_node=False)) is None
    monkeypatch.setattr(lanes, "rdma_devices", lambda: ["mlx5_0"])
    assert faster_lane(_stats("tcp", same_node=False)) == "rdma"
    monkeypatch.setattr(lanes, "ucx_available", lambda: False)
    assert faster_lane(_stats("tcp", same_node=True)) == "sm"  # rlctl's memory files, without UCX
    monkeypatch.setattr(lanes, "shared_memory_supported", lambda: False)
    assert faster_lane(_stats("tcp", same_node=True)) is None  # neither here: tcp is all there is
    assert local_node_id() == local_node_id() and len(local_node_id()) == 16


def _serve(transport: str, tls: str) -> tuple[Any, Any, dict[str, Any]]:
    queue, (stop_reader, stop) = CTX.Queue(), CTX.Pipe(duplex=False)
    holder = CTX.Process(target=weights_procs.lanes_holder_main, args=(transport, tls, queue, stop_reader))
    holder.start()
    return holder, stop, queue.get(timeout=WAIT_S)


def _pull(tls: str, sources: dict[str, dict[str, Any]]) -> Any:
    queue = CTX.Queue()
    joiner = CTX.Process(target=weights_procs.lanes_joiner_main, args=(tls, sources, queue))
    joiner.start()
    return joiner, queue


@needs_ucxx
@pytest.mark.timeout(240)
def test_same_node_pulls_take_shared_memory_where_ucx_allows_and_every_pull_names_its_lanes() -> None:
    ucx_holder, ucx_stop, ucx_source = _serve("ucx", "sm,tcp,self")
    tcp_holder, tcp_stop, tcp_source = _serve("tcp", "tcp,self")
    try:
        assert isinstance(ucx_source["sm_port"], int) and ucx_source["node_id"] == local_node_id()
        listener_only = {k: v for k, v in ucx_source.items() if k != "sm_port"}
        with_sm = _pull("sm,tcp,self", {"same-node": ucx_source, "listener": listener_only, "tcp": tcp_source})
        tcp_only = _pull("tcp,self", {"same-node": ucx_source})
        pulls = {**with_sm[1].get(timeout=WAIT_S), **{f"tcp-only {k}": v for k, v in tcp_only[1].get(timeout=WAIT_S).items()}}
        for process, _ in (with_sm, tcp_only):
            process.join(WAIT_S)
    finally:
        for holder, stop in ((ucx_holder, ucx_stop), (tcp_holder, tcp_stop)):
            stop.send(True)
            holder.join(20)
            if holder.is_alive():
                holder.kill()
    assert all(p.get("lane") for p in pulls.values()), pulls
    same = pulls["same-node"]
    assert (same["transport"], same["lane"], same["same_node"], same["faster_lane"]) == ("ucx-sm", "sm", True, None), same
    assert any(lane.split("/")[0] in ("cma", "sysv", "posix") for lane in same["lanes"]), same
    assert (pulls["listener"]["transport"], pulls["listener"]["lane"], pulls["listener"]["lanes"]) == ("ucx", "tcp", ["tcp/lo"])
    assert pulls["listener"]["faster_lane"] == "sm"
    assert (pulls["tcp"]["transport"], pulls["tcp"]["lanes"], pulls["tcp"]["faster_lane"]) == ("tcp", ["tcp/socket"], "sm")
    blocked = pulls["tcp-only same-node"]
    assert (blocked["transport"], blocked["lane"], blocked["lanes"], blocked["faster_lane"]) == ("ucx-sm", "tcp", ["tcp/lo"], "sm")
    assert all(p["bytes"] == 4 << 20 and p["gbps"] > 0 for p in pulls.values())
