"""Slurm backend against the real lab Slurm: per-role allocations, agents via srun, node loss
seen as a hardware failure, replacement with --exclude, release leaves no job behind."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from conftest import LAB_DIR

from rlctl import lab
from rlctl.agent_bundle import build_agent_zipapp
from rlctl.backends.base import AgentLaunch, AllocationRequest, NodeInfo
from rlctl.backends.slurm import SlurmBackend
from rlctl.backends.slurm_states import JobOutcome, NodeHealth, map_node_state
from rlctl.lab.inject import LabFaultInjector

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def make_backend(status: lab.LabStatus, job_dir: Path) -> SlurmBackend:
    return SlurmBackend(job_dir=job_dir, partition=status.partition, slurm_conf=status.slurm_conf,
                        node_workdir=str(job_dir / "work" / "{node}"), fault_injector=LabFaultInjector(LAB_DIR),
                        allocate_timeout_s=60, replace_timeout_s=60)


def agent_launch(tmp_path: Path) -> AgentLaunch:
    bundle = build_agent_zipapp(tmp_path / "bundle")
    return AgentLaunch(job_id="labslurm", controller_host=lab.CONTROLLER_IP, controller_port=1,
                       secret_hex="cd" * 32, gpu_provider="sim", sim_gpus=1,
                       agent_zipapp=bundle.path, agent_zipapp_sha256=bundle.sha256)


async def wait_for(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_allocate_by_role_node_loss_replace_release(healthy_lab: lab.LabStatus, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"

    async def scenario() -> None:
        backend = make_backend(healthy_lab, job_dir)
        request = AllocationRequest("labslurm", {"trainer": 1, "rollout": 1, "reward": 1}, 0, {"trainer": 2})
        nodes = await backend.allocate(request)
        extra: list[NodeInfo] = []
        try:
            assert [n.extra["role"] for n in nodes] == ["trainer", "rollout", "reward"]
            assert len({n.name for n in nodes}) == 3 and len({n.backend_ref for n in nodes}) == 3
            assert nodes[0].gpus == 2

            launch = agent_launch(tmp_path)
            await asyncio.gather(*(backend.start_agent(n, launch) for n in nodes))
            for n in nodes:
                status = backend.status_path(n).read_text().split()
                assert status[0] == "running"
                assert Path(f"/proc/{status[1]}").exists()  # the agent, started by srun on the node
                assert os.stat(backend.config_path(n)).st_mode & 0o777 == 0o600
                assert launch.secret_hex not in Path(f"/proc/{status[1]}/cmdline").read_text()
            # idempotent: nothing restarts
            before = {n.name: backend.status_path(n).read_text() for n in nodes}
            await asyncio.gather(*(backend.start_agent(n, launch) for n in nodes))
            assert before == {n.name: backend.status_path(n).read_text() for n in nodes}
            for n in nodes:
                assert (await backend.probe(n)).reachable

            victim = nodes[1]
            assert await backend.inject(victim, "node-down", {})

            async def probe_fails() -> bool:
                return not (await backend.probe(victim)).reachable

            await wait_for(probe_fails, 60, f"probe of {victim.name} to fail")

            async def job_ended() -> object:
                verdict = await backend.commands.job_verdict(victim.backend_ref)
                return verdict if verdict.terminal else None

            verdict = await wait_for(job_ended, 90, f"Slurm to end {victim.name}'s allocation")
            assert verdict.outcome is JobOutcome.HARDWARE_FAILED and verdict.hardware, verdict
            assert verdict.reason == "slurm-node-fail"
            node_state = (await backend.commands.show_node(victim.name))["State"]
            assert map_node_state(node_state).health in (NodeHealth.DOWN, NodeHealth.UNREACHABLE), node_state
            # the other roles are untouched
            for n in (nodes[0], nodes[2]):
                assert (await backend.probe(n)).reachable
                assert backend.status_path(n).read_text().startswith("running")

            new = await backend.replace(victim, frozenset({victim.name}))
            assert new is not None
            extra.append(new)
            assert new.name not in {n.name for n in nodes} and new.extra["role"] == "rollout"
            await backend.start_agent(new, launch)
            assert backend.status_path(new).read_text().startswith("running")
        finally:
            await backend.release(nodes + extra)
            await backend.release_all()
            await asyncio.to_thread(lab.node_up, nodes[1].name, state_dir=LAB_DIR)
        ours = {n.backend_ref for n in nodes + extra}
        left = [t for t in await backend.commands.squeue() if t.job_id in ours and t.state in ("PENDING", "RUNNING", "COMPLETING")]
        assert not left, left

    asyncio.run(scenario())


def test_agent_restarts_when_config_rewritten(healthy_lab: lab.LabStatus, tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = make_backend(healthy_lab, tmp_path / "job")
        (node,) = await backend.allocate(AllocationRequest("labslurm", {"reward": 1}, 0, {}))
        try:
            launch = agent_launch(tmp_path)
            await backend.start_agent(node, launch)
            pid = backend.status_path(node).read_text().split()[1]
            os.kill(int(pid), 9)  # the agent dies; the task notices

            async def exited() -> bool:
                return backend.status_path(node).read_text().startswith("exited")

            await wait_for(exited, 10, "the task to notice the dead agent")
            await backend.start_agent(node, launch)  # same config: rewritten as a new file -> restart
            status = backend.status_path(node).read_text().split()
            assert status[0] == "running" and status[1] != pid
        finally:
            await backend.release_all()

    asyncio.run(scenario())
