"""The agent hub's gate: only agents that answer the challenge with the job secret get in, and a
malformed or oversized message closes the connection (the agent must authenticate again)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rlctl_agent import protocol

from rlctl.controller.agents import AgentHub

SECRET = bytes.fromhex("11" * 32)


async def start_hub(received: list[tuple[str, dict[str, Any]]], gone: list[str]) -> tuple[AgentHub, int]:
    async def on_hello(node: str, hello: dict[str, Any]) -> None:
        received.append((node, {"type": "hello"}))

    async def on_message(node: str, message: dict[str, Any]) -> None:
        received.append((node, message))

    async def on_gone(node: str, reason: str) -> None:
        gone.append(node)

    hub = AgentHub(SECRET, lambda node: node in ("node01", "node02"), on_hello, on_message, on_gone, 1.0)
    return hub, await hub.start("127.0.0.1", 0)


async def handshake(port: int, node: str, secret: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=protocol.MAX_MESSAGE_BYTES + 10)
    challenge = protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)
    writer.write(protocol.encode("hello", job_id="j", node=node, incarnation=1,
                                 auth=protocol.auth_digest(secret, challenge["nonce"], node), facts={}))
    await writer.drain()
    answer = protocol.decode(await reader.readline(), protocol.CONTROLLER_TO_AGENT)
    return reader, writer, answer


def test_good_secret_is_welcomed_and_messages_flow() -> None:
    async def scenario() -> None:
        received: list = []
        hub, port = await start_hub(received, [])
        _, writer, answer = await handshake(port, "node01", SECRET)
        assert answer["type"] == "welcome"
        writer.write(protocol.encode("heartbeat", seq=1, mono=0.0, workers=[], gpus=[]))
        await writer.drain()
        await asyncio.sleep(0.2)
        assert [m.get("type") for _, m in received] == ["hello", "heartbeat"]
        assert hub.connected("node01")
        writer.close()
        await hub.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("node,secret", [("node01", bytes(32)), ("node99", SECRET)])
def test_bad_secret_or_unknown_node_is_rejected(node: str, secret: bytes) -> None:
    async def scenario() -> None:
        received: list = []
        hub, port = await start_hub(received, [])
        _, writer, answer = await handshake(port, node, secret)
        assert answer["type"] == "reject"
        assert not received and not hub.connected(node)
        writer.close()
        await hub.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("garbage", [b"not json\n", b'{"v": 99, "type": "heartbeat"}\n', b'{"v": 1, "type": "shutdown"}\n',
                                     b'{"v": 1, "type": "heartbeat", "pad": "' + b"x" * (protocol.MAX_MESSAGE_BYTES + 1) + b'"}\n'])
def test_malformed_messages_close_the_connection(garbage: bytes) -> None:
    async def scenario() -> None:
        received: list = []
        gone: list = []
        hub, port = await start_hub(received, gone)
        reader, writer, answer = await handshake(port, "node02", SECRET)
        assert answer["type"] == "welcome"
        writer.write(garbage)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5.0) == b"", "the hub must close the connection"
        assert gone == ["node02"] and not hub.connected("node02")
        await hub.close()

    asyncio.run(scenario())
