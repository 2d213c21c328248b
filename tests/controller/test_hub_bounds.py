"""What a stranger can make the agent hub hold before authenticating, and fencing at the hub: a
small hello bound, capped unauthenticated connections, a handshake deadline, refusals reported
(rate-limited), the full message bound only after authentication, and an agent that has seen a
newer controller fencing this one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rlctl_agent import protocol

from rlctl.controller import agents
from rlctl.controller.agents import AgentHub, RefusalReporter

SECRET = bytes.fromhex("22" * 32)


async def start_hub(refusals: list[tuple[str, str, str, int]], fenced: list[int], epoch: int = 1) -> tuple[AgentHub, int]:
    async def on_hello(node: str, hello: dict[str, Any]) -> None:
        return None

    async def on_message(node: str, message: dict[str, Any]) -> None:
        return None

    async def on_gone(node: str, reason: str) -> None:
        return None

    hub = AgentHub(SECRET, lambda node: node == "node01", on_hello, on_message, on_gone, 1.0,
                   on_refused=lambda *args: refusals.append(args), on_fenced=fenced.append)
    hub.epoch = epoch
    return hub, await hub.start("127.0.0.1", 0)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the hub closes the connection within ``seconds`` (whatever it wrote first is read)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_an_oversized_hello_is_refused_at_the_small_bound_and_reported() -> None:
    async def scenario() -> None:
        refusals: list = []
        hub, port = await start_hub(refusals, [])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await reader.readline()  # the challenge
        try:
            writer.write(b"x" * (agents.HELLO_MAX_BYTES * 4))  # no newline, no authentication
            await writer.drain()
        except ConnectionError:
            pass
        assert await closed_within(reader, 3.0)
        await asyncio.sleep(0.1)
        assert refusals and refusals[0][0] == "127.0.0.1" and "bad hello" in refusals[0][2]
        await hub.close()

    asyncio.run(scenario())


def test_unauthenticated_connections_are_capped_per_source_and_the_extra_one_closed_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agents, "MAX_UNAUTHENTICATED_PER_SOURCE", 3)

    async def scenario() -> None:
        refusals: list = []
        hub, port = await start_hub(refusals, [])
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, _ in held:
            await reader.readline()  # each got its challenge and stays silent
        extra_reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(extra_reader, 1.0)
        assert any("too many unauthenticated" in r[2] for r in refusals)
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)
        # Once they are gone, the same source may connect again and is challenged.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)["type"] == "challenge"
        writer.close()
        await hub.close()

    asyncio.run(scenario())


def test_a_silent_connection_is_dropped_at_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agents, "HANDSHAKE_TIMEOUT_S", 0.5)

    async def scenario() -> None:
        refusals: list = []
        hub, port = await start_hub(refusals, [])
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        await reader.readline()
        assert await closed_within(reader, 2.0)
        assert any("no valid hello" in r[2] for r in refusals)
        await hub.close()

    asyncio.run(scenario())


def test_after_authentication_a_large_message_is_allowed() -> None:
    async def scenario() -> None:
        got: list[dict[str, Any]] = []

        async def on_message(node: str, message: dict[str, Any]) -> None:
            got.append(message)

        async def nothing(*_: Any) -> None:
            return None

        hub = AgentHub(SECRET, lambda node: node == "node01", nothing, on_message, nothing, 1.0)
        port = await hub.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=protocol.MAX_MESSAGE_BYTES)
        challenge = protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)
        writer.write(protocol.encode("hello", job_id="j", node="node01", incarnation=1, epoch=0,
                                     auth=protocol.auth_digest(SECRET, challenge["nonce"], "node01"), facts={}))
        assert protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)["type"] == "welcome"
        big = "y" * (agents.HELLO_MAX_BYTES * 20)
        writer.write(protocol.encode("worker_msg", wid="w", payload={"kind": "notify", "blob": big}))
        await writer.drain()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.05)
        assert got and got[0]["payload"]["blob"] == big
        writer.close()
        await hub.close()

    asyncio.run(scenario())


def test_an_agent_that_has_seen_a_newer_controller_fences_this_one() -> None:
    async def scenario() -> None:
        fenced: list[int] = []
        hub, port = await start_hub([], fenced, epoch=3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        challenge = protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)
        writer.write(protocol.encode("hello", job_id="j", node="node01", incarnation=1, epoch=4,
                                     auth=protocol.auth_digest(SECRET, challenge["nonce"], "node01"), facts={}))
        answer = protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)
        assert answer["type"] == "reject" and "superseded" in answer["reason"]
        assert fenced == [4] and not hub.connected("node01")
        await hub.close()

    asyncio.run(scenario())


def test_refusals_are_reported_once_per_source_per_window_with_a_count() -> None:
    now = [0.0]
    reports: list[tuple[str, str, str, int]] = []
    later: list[tuple[float, object]] = []
    reporter = RefusalReporter(lambda *args: reports.append(args), every_s=10.0, clock=lambda: now[0],
                               schedule=lambda delay, action: later.append((delay, action)))
    for _ in range(50):
        reporter.refused("10.0.0.9", "node01", "authentication failed")
    reporter.refused("10.0.0.8", "", "bad hello")
    assert reports == [("10.0.0.9", "node01", "authentication failed", 1), ("10.0.0.8", "", "bad hello", 1)]
    assert len(later) == 1 and later[0][0] == 10.0  # the 49 folded ones are reported when the window ends
    now[0] = 10.0
    later[0][1]()  # type: ignore[operator]
    assert reports[-1] == ("10.0.0.9", "node01", "authentication failed", 49)
    now[0] = 25.0
    reporter.refused("10.0.0.9", "node01", "authentication failed")
    assert reports[-1] == ("10.0.0.9", "node01", "authentication failed", 1)
