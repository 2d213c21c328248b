"""The agent's worker SDK relay over a real unix socket: a worker's message nested deeper than the
protocol's bound (which re-encoding it for the controller could not survive) drops that worker's
connection with a warning, and the relay goes on serving the others."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from rlctl_agent.protocol import MAX_NESTING
from rlctl_agent.relay import WorkerRelay


class Recorder:
    def __init__(self) -> None:
        self.msgs: list[tuple[str, Any]] = []

    def is_known_worker(self, wid: str) -> bool:
        return wid in ("w1", "w2")

    def on_worker_phase(self, wid: str, phase: str, step: int | None) -> None: ...

    def on_worker_progress(self, wid: str, value: Any) -> None: ...

    def on_worker_msg(self, wid: str, payload: Any) -> None:
        self.msgs.append((wid, payload))


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


async def talk(path: Path, wid: str, payload: Any) -> bool:
    """Send a hello and one message; True if the relay kept the connection open afterwards."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    for message in ({"type": "hello", "wid": wid}, {"type": "msg", "payload": payload}):
        writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()
    try:
        closed = await asyncio.wait_for(reader.read(), 0.5) == b""
    except TimeoutError:
        closed = False
    writer.close()
    return not closed


def test_a_message_nested_past_the_bound_drops_only_that_connection(tmp_path: Path) -> None:
    async def run() -> tuple[bool, bool, list[tuple[str, Any]]]:
        recorder = Recorder()
        relay = WorkerRelay(tmp_path / "sdk.sock", recorder)
        await relay.start()
        try:
            too_deep = await talk(tmp_path / "sdk.sock", "w1", nested(MAX_NESTING + 5))
            fine = await talk(tmp_path / "sdk.sock", "w2", nested(MAX_NESTING - 2))
            return too_deep, fine, recorder.msgs
        finally:
            await relay.close()

    too_deep_kept, fine_kept, msgs = asyncio.run(run())
    assert not too_deep_kept and fine_kept
    assert [wid for wid, _ in msgs] == ["w2"]
