"""Benchmark: deploy the real agent to N lab nodes over SSH and over Slurm (srun), in seconds.

Usage (root; rebuilds the lab at each size):
    .venv/bin/python bench/deploy_agents.py --nodes 16 64
Measures, per size:
  ssh_cold_s   start_agent on every node with a zipapp the nodes do not have (SFTP upload + 0600
               config + detached start), all nodes concurrently (max_parallel = 64)
  ssh_warm_s   the same call again: hash unchanged, agent running -> nothing shipped (idempotency)
  srun_alloc_s allocate N single-node array tasks (one sbatch) until all run
  srun_agent_s start_agent on every node (0600 config on the shared FS -> the srun task starts it)
  srun_total_s allocation + agents
Prints a table, then one JSON object on the last line. Target: 64 nodes within 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rlctl import lab
from rlctl.agent_bundle import build_agent_zipapp
from rlctl.backends.base import AgentLaunch, AllocationRequest
from rlctl.backends.slurm import SlurmBackend
from rlctl.backends.ssh import SshBackend, hosts_from_lab

REMOTE_ROOT = f"/tmp/rlctl-bench-{os.getpid()}"  # writable by the lab's login user


def launch_for(bundle_dir: Path, job_id: str) -> AgentLaunch:
    bundle = build_agent_zipapp(bundle_dir)
    return AgentLaunch(job_id=job_id, controller_host=lab.CONTROLLER_IP, controller_port=1, secret_hex="ef" * 32,
                       gpu_provider="none", sim_gpus=0, agent_zipapp=bundle.path,
                       agent_zipapp_sha256=bundle.sha256)


async def bench_ssh(status: lab.LabStatus, work: Path, n: int) -> dict[str, float]:
    backend = SshBackend(hosts_from_lab([(x.name, x.ip) for x in status.nodes]), known_hosts=status.known_hosts,
                         key_file=status.ssh_key, job_dir=work / "ssh-job", max_parallel=64,
                         remote_dir=f"{REMOTE_ROOT}/{{node}}")
    nodes = await backend.allocate(AllocationRequest("bench-ssh", {"rollout": n}, 0, {}))
    launch = launch_for(work / "bundle", "bench-ssh")
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(backend.start_agent(x, launch) for x in nodes))
        cold = time.perf_counter() - t0
        assert all(o.uploaded_zipapp and o.started for o in backend.last_deploy.values())
        t0 = time.perf_counter()
        await asyncio.gather(*(backend.start_agent(x, launch) for x in nodes))
        warm = time.perf_counter() - t0
        assert not any(o.uploaded_zipapp or o.started for o in backend.last_deploy.values())
    finally:
        await backend.release(nodes, clean=True)
        await backend.close()
        shutil.rmtree(REMOTE_ROOT, ignore_errors=True)  # lab nodes share this filesystem
    return {"ssh_cold_s": round(cold, 3), "ssh_warm_s": round(warm, 3)}


async def bench_srun(status: lab.LabStatus, work: Path, n: int) -> dict[str, float]:
    backend = SlurmBackend(job_dir=work / "slurm-job", partition=status.partition, slurm_conf=status.slurm_conf,
                           node_workdir=str(work / "slurm-work" / "{node}"), allocate_timeout_s=120)
    launch = launch_for(work / "bundle", "bench-srun")
    try:
        t0 = time.perf_counter()
        nodes = await backend.allocate(AllocationRequest("bench-srun", {"rollout": n}, 0, {}))
        alloc = time.perf_counter() - t0
        t1 = time.perf_counter()
        await asyncio.gather(*(backend.start_agent(x, launch) for x in nodes))
        agents = time.perf_counter() - t1
    finally:
        await backend.release_all()
    return {"srun_alloc_s": round(alloc, 3), "srun_agent_s": round(agents, 3), "srun_total_s": round(alloc + agents, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--state-dir", type=Path, default=lab.DEFAULT_STATE_DIR)
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    for n in args.nodes:
        t0 = time.perf_counter()
        status = lab.up(n, 0, state_dir=args.state_dir, idle_timeout_s=300)
        lab_up = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(prefix="rlctl-bench-") as tmp:
            work = Path(tmp)
            row = {"lab_up_s": round(lab_up, 2)}
            row |= asyncio.run(bench_ssh(status, work, n))
            row |= asyncio.run(bench_srun(status, work, n))
        results[str(n)] = row
        print(f"{n:>4} nodes: " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    largest = results[str(max(args.nodes))]
    summary = {"bench": "deploy_agents", "results": results,
               "target_64_nodes_s": 10.0,
               "meets_target": all(v <= 10.0 for k, v in largest.items() if k in ("ssh_cold_s", "srun_total_s"))}
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
