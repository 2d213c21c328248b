"""Sharded point-to-point weight sync against gathering to rank 0, and against a checkpoint reload.

The weights of the ~0.5B-parameter Qwen3 of ``hf_init`` (size ``0.5b``, random init, bfloat16 as
on the wire, 0.95 GB) are split into N trainer ranks' shards the way ``fully_shard`` splits dim 0
(each rank its own process, a gloo group among them). Then a new version reaches 2 rollouts (each
its own process), timed from the moment every rank holds its shard to the moment both rollouts
hold the whole model, verified:

- ``sharded``: every rank serves its own shard (``WeightServerThread``), rank 0 combines the
  descriptors, each rollout pulls all shards at once and assembles them (``rlctl.weights.shards``).
- ``gathered`` (baseline): the ranks send their shards to rank 0 (gloo point to point), rank 0
  puts the model together and serves it, each rollout pulls it.
- ``disk`` (baseline): each rollout reads the same weights from a safetensors checkpoint, cold
  (dropped from the page cache with ``posix_fadvise``) and warm.

    python bench/sharded_weight_sync.py [--ranks 1,2,4] [--transport tcp] [--repeats 2]
    python bench/sharded_weight_sync.py --link-mbit 1000   # as root: each rank behind its own link

On one loopback the N ranks and both rollouts copy every byte through the same two cores, so the
time cannot fall as 1/N. ``--link-mbit`` puts each trainer rank on its own lab node behind a link
of that rate (``lablinks.ShapedNodes``; the ranks' gloo group runs over the lab bridge), the
rollouts on the bridge: what a cluster gives, one NIC per trainer node. TCP only.

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl.workload.rendezvous import held_store

CTX = mp.get_context("spawn")
ROLLOUTS = 2
VERSION = 1


def set_env(transport: str) -> None:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS="tcp,self", UCXPY_PROGRESS_MODE="blocking",
                      UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1")


def load_shard(path: str, rank: int, ranks: int) -> dict[str, Any]:
    from safetensors import safe_open

    from rlctl.weights.shards import shard_rows

    shard = {}
    with safe_open(path, framework="pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = weights.get_slice(name)
            rows = tensor.get_shape()[0]
            start, stop = shard_rows(rows, ranks, rank)
            shard[name] = tensor[start:stop].contiguous()
    return shard


def rank_main(rank: int, ranks: int, mode: str, path: str, rendezvous: dict[str, str], transport: str, out: Any, go: Any,
              done: Any) -> None:
    set_env(transport)
    os.environ.update(rendezvous)  # join the bench's held store as a client
    init_method = f"tcp://{rendezvous['MASTER_ADDR']}:{rendezvous['MASTER_PORT']}"
    rank_sync(rank, ranks, mode, path, init_method, "127.0.0.1", transport,
              go.wait, lambda started, source: out.put((started, source)), done.wait)


def lab_rank_main(rank: int, ranks: int, mode: str, path: str, master: str, host: str) -> None:
    """One rank on a lab node (``--link-mbit``): talks to the bench over its stdin and stdout."""
    set_env("tcp")
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"

    def report(started: float, source: dict[str, Any]) -> None:
        print(json.dumps({"started": started, "source": source}), flush=True)

    def ready() -> None:
        print("ready", flush=True)
        sys.stdin.readline()  # go

    rank_sync(rank, ranks, mode, path, f"tcp://{master}", host, "tcp", ready, report, sys.stdin.read)


def rank_sync(rank: int, ranks: int, mode: str, path: str, init_method: str, host: str, transport: str,
              wait_go: Callable[[], Any], report: Callable[[float, dict[str, Any]], None],
              wait_done: Callable[[], Any]) -> None:
    """Hold this rank's shard, then (timed from a barrier after ``wait_go``) publish the version:
    every rank serves its shard, or the shards go to rank 0, which serves the whole. Rank 0
    ``report``s when the clock started and the source the rollouts pull."""
    import torch
    import torch.distributed as dist

    from rlctl.weights import WeightServerThread
    from rlctl.weights.shards import combine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=ranks)
    shard = load_shard(path, rank, ranks)
    server = WeightServerThread(transport, host=host) if mode == "sharded" or rank == 0 else None
    if server is not None:
        server.start()
    wait_go()  # the rollouts are up and waiting
    dist.barrier()
    started = time.time()
    if mode == "sharded":
        assert server is not None
        descriptors: list[Any] = [None] * ranks
        dist.all_gather_object(descriptors, server.publish(VERSION, shard))
        if rank == 0:
            report(started, combine(descriptors, VERSION))
    else:
        names = list(shard)
        if rank == 0:
            parts: dict[str, list[Any]] = {name: [shard[name]] for name in names}
            for peer in range(1, ranks):
                sizes: list[Any] = [None]
                dist.recv_object_list(sizes, src=peer)
                for name, shape in zip(names, sizes[0]):
                    received = torch.empty(shape, dtype=shard[name].dtype)
                    dist.recv(received.view(torch.int16), src=peer)
                    parts[name].append(received)
            assert server is not None
            report(started, server.publish(VERSION, {name: torch.cat(parts[name]) for name in names}))
        else:
            dist.send_object_list([[list(shard[name].shape) for name in names]], dst=0)
            for name in names:
                dist.send(shard[name].view(torch.int16), dst=0)
    wait_done()
    if server is not None:
        server.close()
    dist.destroy_process_group()


def rollout_main(source_queue: Any, out: Any, transport: str) -> None:
    set_env(transport)
    import torch  # noqa: F401  (imported before the clock starts, as in a running rollout)

    from rlctl.weights import unflatten
    from rlctl.weights.shards import fetch_source_sync

    out.put("ready")
    source = source_queue.get()
    bundle = fetch_source_sync(source, timeout=600)
    state = unflatten(bundle.manifest, bundle.buffer)
    out.put((time.time(), bundle.manifest.nbytes, len(state)))


def disk_main(path: str, out: Any, cold: bool) -> None:
    from safetensors.torch import load_file

    if cold:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    started = time.time()
    state = load_file(path)
    copies = [t.clone() for t in state.values()]  # every byte read (the file is mapped lazily)
    out.put((time.time() - started, len(copies)))


LAB_RENDEZVOUS_PORT = 29500  # on lab node 0, in its own network namespace: nothing else binds there


def sync_once(path: str, ranks: int, mode: str, transport: str) -> float:
    """Seconds from every rank holding its shard to both rollouts holding the whole model (their
    gloo group meets at a store this process holds: ``held_store``)."""
    with held_store() as rendezvous:
        return _sync_once(path, ranks, mode, transport, rendezvous)


def _sync_once(path: str, ranks: int, mode: str, transport: str, rendezvous: dict[str, str]) -> float:
    rank_out, source_queues, rollout_out = CTX.Queue(), [CTX.Queue() for _ in range(ROLLOUTS)], CTX.Queue()
    go, done = CTX.Event(), CTX.Event()
    procs = [CTX.Process(target=rank_main, args=(r, ranks, mode, path, rendezvous, transport, rank_out, go, done))
             for r in range(ranks)]
    procs += [CTX.Process(target=rollout_main, args=(q, rollout_out, transport)) for q in source_queues]
    for proc in procs:
        proc.start()
    try:
        for _ in range(ROLLOUTS):
            assert rollout_out.get(timeout=300) == "ready"
        go.set()
        started, source = rank_out.get(timeout=900)
        for queue in source_queues:
            queue.put(source)
        ends = [rollout_out.get(timeout=900) for _ in range(ROLLOUTS)]
        return max(end for end, _, _ in ends) - started
    finally:
        done.set()
        for proc in procs:
            proc.join(120)
            if proc.is_alive():
                proc.kill()


def lab_sync_once(nodes: Any, path: str, ranks: int, mode: str) -> float:
    """``sync_once`` with every rank on its own lab node behind its own link, the rollouts on the bridge."""
    source_queues, rollout_out = [CTX.Queue() for _ in range(ROLLOUTS)], CTX.Queue()
    master = f"{nodes.ip(0)}:{LAB_RENDEZVOUS_PORT}"
    children = [nodes.spawn(r, [__file__, "--lab-rank", str(r), "--ranks", str(ranks), "--mode", mode, "--path", path,
                                "--master", master, "--host", nodes.ip(r)]) for r in range(ranks)]
    rollouts = [CTX.Process(target=rollout_main, args=(q, rollout_out, "tcp")) for q in source_queues]
    for proc in rollouts:
        proc.start()
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range(ROLLOUTS):
            assert rollout_out.get(timeout=300) == "ready"
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        assert children[0].stdout is not None
        published = json.loads(children[0].stdout.readline())
        for queue in source_queues:
            queue.put(published["source"])
        ends = [rollout_out.get(timeout=900) for _ in range(ROLLOUTS)]
        return max(end for end, _, _ in ends) - float(published["started"])
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(120)
        for proc in rollouts:
            proc.join(120)
            if proc.is_alive():
                proc.kill()


def disk_once(path: str, cold: bool) -> float:
    out = CTX.Queue()
    procs = [CTX.Process(target=disk_main, args=(path, out, cold)) for _ in range(ROLLOUTS)]
    for proc in procs:
        proc.start()
    seconds = max(out.get(timeout=900)[0] for _ in procs)
    for proc in procs:
        proc.join(60)
    return seconds


def make_model(folder: Path, size: str) -> tuple[str, int]:
    import torch
    from safetensors.torch import save_file

    from rlctl.workload.hf_init import random_policy

    state = {k: v.to(torch.bfloat16).contiguous() for k, v in random_policy("qwen3", size, seed=0).state_dict().items()}
    path = folder / "model.safetensors"
    save_file(state, str(path))
    return str(path), sum(v.numel() * v.element_size() for v in state.values())


def measure(args: argparse.Namespace, rank_counts: list[int], nodes: Any) -> tuple[list[dict[str, Any]], int, dict[str, list[float]]]:
    """Every (ranks, mode) arm ``args.repeats`` times, then the disk baselines."""
    with tempfile.TemporaryDirectory(prefix="rlctl-sharded-sync-") as tmp:
        path, nbytes = make_model(Path(tmp), args.size)
        print(f"[sharded_weight_sync] model {nbytes / 1e9:.2f} GB bf16", file=sys.stderr, flush=True)
        rows: list[dict[str, Any]] = []
        for ranks in rank_counts:
            for mode in ("sharded", "gathered"):
                times = [lab_sync_once(nodes, path, ranks, mode) if nodes is not None
                         else sync_once(path, ranks, mode, args.transport) for _ in range(args.repeats)]
                row = {"ranks": ranks, "mode": mode, "seconds": round(statistics.median(times), 3),
                       "runs": [round(t, 3) for t in times]}
                print(f"[sharded_weight_sync] {row}", file=sys.stderr, flush=True)
                rows.append(row)
        disk = {"cold": [disk_once(path, True) for _ in range(args.repeats)],
                "warm": [disk_once(path, False) for _ in range(args.repeats)]}
        print(f"[sharded_weight_sync] disk {disk}", file=sys.stderr, flush=True)
    return rows, nbytes, disk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ucx"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--link-mbit", type=int, default=0,
                        help="each trainer rank on its own lab node behind a link of this rate (root; TCP)")
    for hidden in ("--lab-rank", "--mode", "--path", "--master", "--host"):
        parser.add_argument(hidden, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lab_rank:
        lab_rank_main(int(args.lab_rank), int(args.ranks), args.mode, args.path, args.master, args.host)
        return
    set_env(args.transport)
    rank_counts = [int(n) for n in args.ranks.split(",")]
    nodes = None
    if args.link_mbit:
        from lablinks import ShapedNodes

        nodes = ShapedNodes(max(rank_counts), args.link_mbit)
    try:
        rows, nbytes, disk = measure(args, rank_counts, nodes)
    finally:
        if nodes is not None:
            nodes.close()

    sharded = {r["ranks"]: r["seconds"] for r in rows if r["mode"] == "sharded"}
    gathered = {r["ranks"]: r["seconds"] for r in rows if r["mode"] == "gathered"}
    disk_cold = statistics.median(disk["cold"])
    best = min(sharded.values())
    print(json.dumps({
        "model_bytes": nbytes, "rollouts": ROLLOUTS, "transport": args.transport, "link_mbit": args.link_mbit,
        "results": rows,
        "disk_cold_s": round(disk_cold, 3), "disk_warm_s": round(statistics.median(disk["warm"]), 3),
        "sharded_over_1_rank": {n: round(s / sharded[rank_counts[0]], 3) for n, s in sharded.items()},
        "gathered_over_sharded": {n: round(gathered[n] / sharded[n], 3) for n in sharded},
        "disk_cold_over_best_sharded": round(disk_cold / best, 2),
        "goal": "time close to 1/N of one rank's, and >= 3x faster than a cold checkpoint reload",
        "meets_disk_goal": disk_cold / best >= 3.0,
    }))


if __name__ == "__main__":
    main()
