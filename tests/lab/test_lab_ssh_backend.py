"""SSH backend against real sshd in the lab: agent deploy, hash-skipped re-upload, probe vs partition."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LAB_DIR, LAB_NODES

from rlctl import lab
from rlctl.agent_bundle import build_agent_zipapp
from rlctl.backends.base import AgentLaunch, AllocationRequest
from rlctl.backends.ssh import SshBackend, hosts_from_lab
from rlctl.lab.inject import LabFaultInjector

pytestmark = pytest.mark.lab
REMOTE_ROOT = f"/tmp/rlctl-labtest-{os.getpid()}"


@pytest.fixture(autouse=True, scope="module")
def _remove_remote_root() -> Iterator[None]:
    yield
    shutil.rmtree(REMOTE_ROOT, ignore_errors=True)  # lab nodes share this machine's filesystem


def make_backend(status: lab.LabStatus, job_dir: Path) -> SshBackend:
    hosts = hosts_from_lab([(n.name, n.ip) for n in status.nodes], spares=[status.nodes[-1].name])
    return SshBackend(hosts, known_hosts=status.known_hosts, key_file=status.ssh_key, job_dir=job_dir,
                      remote_dir=f"{REMOTE_ROOT}/{{node}}", probe_timeout_s=3.0,
                      fault_injector=LabFaultInjector(LAB_DIR))


def launch(tmp_path: Path) -> AgentLaunch:
    bundle = build_agent_zipapp(tmp_path / "bundle")
    return AgentLaunch(job_id="labssh", controller_host=lab.CONTROLLER_IP, controller_port=1, secret_hex="ab" * 32,
                       gpu_provider="sim", sim_gpus=1, agent_zipapp=bundle.path,
                       agent_zipapp_sha256=bundle.sha256)


def test_lab_status_reports_nodes_and_job_facts(lab_status: lab.LabStatus) -> None:
    assert lab_status.up and len(lab_status.nodes) == LAB_NODES
    assert lab_status.controller_address == "10.213.0.1" and lab_status.partition == "main"
    assert lab_status.known_hosts and lab_status.known_hosts.exists()
    assert "node01=10.213.0.11" in lab_status.job_toml()


def test_start_agent_upload_once_config_private(healthy_lab: lab.LabStatus, tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = make_backend(healthy_lab, tmp_path / "job")
        nodes = await backend.allocate(AllocationRequest("labssh", {"rollout": 2}, 0, {}))
        spec = launch(tmp_path)
        try:
            await asyncio.gather(*(backend.start_agent(n, spec) for n in nodes))
            first = dict(backend.last_deploy)
            assert all(o.uploaded_zipapp and o.wrote_config and o.started for o in first.values())
            # same zipapp + config: no upload, no restart (hash compared with the remote sha256sum)
            await asyncio.gather(*(backend.start_agent(n, spec) for n in nodes))
            for n in nodes:
                again = backend.last_deploy[n.name]
                assert not again.uploaded_zipapp and not again.wrote_config and not again.started
                assert again.pid == first[n.name].pid
                paths = backend.paths(n, "labssh")
                mode = await backend.run_command(n, f"stat -c %a {paths.config}; hostname")
                assert mode.split() == ["600", n.name]
                alive = await backend.run_command(n, f"kill -0 {again.pid} && echo alive")
                assert "alive" in alive
                # the secret is never on a command line
                cmdline = await backend.run_command(n, f"tr '\\0' ' ' </proc/{again.pid}/cmdline")
                assert spec.secret_hex not in cmdline
        finally:
            await backend.release(nodes, clean=True)
            for n in nodes:
                assert backend.last_deploy[n.name].pid is not None
            gone = await backend.run_command(nodes[0], f"kill -0 {backend.last_deploy[nodes[0].name].pid} "
                                                       "2>/dev/null && echo alive || echo gone")
            assert gone.strip() == "gone"
            await backend.close()

    asyncio.run(scenario())


def test_probe_partition_heal(healthy_lab: lab.LabStatus, tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = make_backend(healthy_lab, tmp_path / "job")
        node = (await backend.allocate(AllocationRequest("labssh", {"rollout": 1}, 0, {})))[0]
        try:
            assert (await backend.probe(node)).reachable
            assert await backend.inject(node, "partition", {})
            result = await backend.probe(node)
            assert not result.reachable and node.name in result.detail
            assert await backend.inject(node, "heal", {})
            for _ in range(20):
                result = await backend.probe(node)
                if result.reachable:
                    break
                await asyncio.sleep(0.5)
            assert result.reachable, result.detail
        finally:
            await asyncio.to_thread(lab.heal, node.name, state_dir=LAB_DIR)
            await backend.close()

    asyncio.run(scenario())


PAYLOAD = "head -c 65536 /dev/zero"


def test_slow_link_adds_latency(healthy_lab: lab.LabStatus, tmp_path: Path) -> None:
    async def scenario() -> tuple[float, float]:
        backend = make_backend(healthy_lab, tmp_path / "job")
        node = (await backend.allocate(AllocationRequest("labssh", {"rollout": 1}, 0, {})))[0]
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await backend.run_command(node, PAYLOAD)
            fast = loop.time() - t0
            assert await backend.inject(node, "slow", {"delay_ms": 50})
            t0 = loop.time()
            await backend.run_command(node, PAYLOAD)
            slow = loop.time() - t0
            return fast, slow
        finally:
            await asyncio.to_thread(lab.heal, node.name, state_dir=LAB_DIR)
            await backend.close()

    fast, slow = asyncio.run(scenario())
    # netem: >= a few 50 ms round trips; tbf (no netem in the kernel): 64 KiB at 240 kbit/s ~ 2 s
    assert slow > fast + 0.15, (fast, slow)
