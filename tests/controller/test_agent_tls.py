"""TLS on the agent link: a real agent process pins the job's certificate and joins a real hub over
TLS; a plain-TCP client and an agent pinning another job's certificate get nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rlctl_agent.config import ConfigError, parse_config

from rlctl.controller import agents
from rlctl.controller.agents import AgentHub
from rlctl.controller.tls import ensure_job_certificate, server_context, tls_enabled

pytestmark = pytest.mark.timeout(60)

SECRET = bytes.fromhex("7a" * 32)


def test_the_job_certificate_is_private_made_once_and_remade_if_half_written(tmp_path: Path) -> None:
    first = ensure_job_certificate(tmp_path, "job-a")
    assert stat.S_IMODE(first.key_path.stat().st_mode) == 0o600
    assert first.cert_pem.startswith("-----BEGIN CERTIFICATE-----")
    assert ensure_job_certificate(tmp_path, "job-a").cert_pem == first.cert_pem  # a resumed controller
    first.cert_path.unlink()
    assert ensure_job_certificate(tmp_path, "job-a").cert_pem != first.cert_pem


def test_auto_is_on_where_agents_cross_a_network() -> None:
    from rlctl.backends.local import LocalBackend
    from rlctl.backends.slurm import SlurmBackend
    from rlctl.backends.ssh import SshBackend

    crossing = [not backend.on_this_machine for backend in (LocalBackend, SshBackend, SlurmBackend)]
    assert [tls_enabled("auto", c) for c in crossing] == [False, True, True]
    assert tls_enabled("on", crosses_network=False) and not tls_enabled("off", crosses_network=True)


def test_a_config_with_a_broken_certificate_is_refused() -> None:
    raw = {"job_id": "j", "node": "node01", "controller_host": "127.0.0.1", "controller_port": 1,
           "secret_hex": SECRET.hex(), "workdir": "/tmp", "tls_cert_pem": "not a certificate"}
    with pytest.raises(ConfigError, match="tls_cert_pem"):
        parse_config(raw, source="agent.json")


def _spawn_agent(workdir: Path, port: int, cert_pem: str) -> subprocess.Popen[bytes]:
    config = workdir / "agent.json"
    config.write_text(json.dumps({
        "job_id": "job-tls", "node": "node01", "controller_host": "127.0.0.1", "controller_port": port,
        "secret_hex": SECRET.hex(), "workdir": str(workdir), "gpu_provider": "sim", "sim_gpus": 1,
        "heartbeat_interval_s": 0.2, "tls_cert_pem": cert_pem,
    }))
    config.chmod(0o600)
    log = (workdir / "agent.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "rlctl_agent", "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def _start_hub(job_dir: Path, heartbeats: list[dict[str, Any]],
                     refusals: list[tuple[str, str, str, int]] | None = None) -> tuple[AgentHub, int]:
    async def on_hello(node: str, hello: dict[str, Any]) -> None:
        return None

    async def on_message(node: str, message: dict[str, Any]) -> None:
        if message.get("type") == "heartbeat":
            heartbeats.append(message)

    async def on_gone(node: str, reason: str) -> None:
        return None

    hub = AgentHub(SECRET, lambda node: node == "node01", on_hello, on_message, on_gone, 0.2,
                   on_refused=None if refusals is None else (lambda *args: refusals.append(args)))
    certificate = ensure_job_certificate(job_dir, "job-tls")
    return hub, await hub.start("127.0.0.1", 0, server_context(certificate))


def test_an_agent_pinning_the_job_certificate_joins_and_plain_tcp_gets_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        heartbeats: list[dict[str, Any]] = []
        hub, port = await _start_hub(tmp_path, heartbeats)
        (tmp_path / "node01").mkdir()
        agent = _spawn_agent(tmp_path / "node01", port, (tmp_path / "agent-tls.crt").read_text())
        try:
            for _ in range(200):
                if hub.connected("node01") and heartbeats:
                    break
                await asyncio.sleep(0.05)
            assert hub.connected("node01") and heartbeats, (tmp_path / "node01" / "agent.log").read_text()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b'{"v": 1, "type": "hello"}\n')
            line = await asyncio.wait_for(reader.readline(), 5)
            assert not line.startswith(b"{")  # no challenge in clear text, only the end of a failed handshake
            writer.close()
        finally:
            agent.kill()
            agent.wait(5)
            await hub.close()

    asyncio.run(scenario())


def test_an_agent_pinning_another_jobs_certificate_refuses_the_controller(tmp_path: Path) -> None:
    async def scenario() -> None:
        heartbeats: list[dict[str, Any]] = []
        (tmp_path / "job").mkdir()
        hub, port = await _start_hub(tmp_path / "job", heartbeats)
        other = ensure_job_certificate(tmp_path, "another-job").cert_pem
        (tmp_path / "node01").mkdir()
        agent = _spawn_agent(tmp_path / "node01", port, other)
        try:
            log = tmp_path / "node01" / "agent.log"
            for _ in range(200):
                if "failed the TLS check" in log.read_text():
                    break
                await asyncio.sleep(0.05)
            assert "failed the TLS check" in log.read_text()
            assert not hub.connected("node01") and not heartbeats
        finally:
            agent.kill()
            agent.wait(5)
            await hub.close()

    asyncio.run(scenario())


def _pinned_client(cert_pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=cert_pem)
    return context


def test_a_client_hello_waiting_before_the_hub_accepts_is_not_lost(tmp_path: Path) -> None:
    """Clients connect and send their ClientHello while the hub's loop is busy; when it accepts,
    each hello is already in the socket. Every one completes TLS and gets the challenge."""
    async def scenario() -> None:
        hub, port = await _start_hub(tmp_path, [])
        client = _pinned_client((tmp_path / "agent-tls.crt").read_text())
        challenges: list[bytes] = []

        def connect() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, client.wrap_socket(raw) as tls:
                challenges.append(tls.makefile("rb").readline())

        threads = [threading.Thread(target=connect) for _ in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # noqa: ASYNC251  # blocks the hub's loop on purpose: the ClientHellos wait unread
        try:
            await asyncio.to_thread(lambda: [thread.join(15) for thread in threads])
            assert len(challenges) == 8 and all(b'"challenge"' in line for line in challenges), challenges
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_tls_handshakes_count_against_the_unauthenticated_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strangers that open the port and never start TLS hold the per-source cap; the next TLS
    client is closed at once, before any handshake, and the refusal is reported."""
    monkeypatch.setattr(agents, "MAX_UNAUTHENTICATED_PER_SOURCE", 3)

    async def scenario() -> None:
        refusals: list[tuple[str, str, str, int]] = []
        hub, port = await _start_hub(tmp_path, [], refusals)
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        try:
            await asyncio.sleep(0.2)
            started = time.monotonic()
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(asyncio.open_connection(
                    "127.0.0.1", port, ssl=_pinned_client((tmp_path / "agent-tls.crt").read_text())), 5)
            assert time.monotonic() - started < 2.0
            assert any(r[2] == "too many unauthenticated connections" for r in refusals), refusals
            for _, writer in silent:
                writer.close()
            await asyncio.sleep(0.2)
            _, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=_pinned_client((tmp_path / "agent-tls.crt").read_text())), 5)
            writer.close()  # the cap is free again once the strangers left
        finally:
            await hub.close()

    asyncio.run(scenario())
