"""Run as a program: one holder per transport made with a job token, pulled from without the token
(must be refused) and with it (must succeed). Prints one JSON line of outcomes per transport."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

from rlctl.weights import WeightError
from rlctl.weights.auth import TOKEN_ENV
from rlctl.weights.client import fetch
from rlctl.weights.server import WeightServer

TOKEN = bytes(range(32))


async def outcome(source: dict, token: str | None) -> str:
    if token is None:
        os.environ.pop(TOKEN_ENV, None)
    else:
        os.environ[TOKEN_ENV] = token
    try:
        version, state = await fetch(source, timeout=10.0)
    except WeightError as exc:
        return f"refused: {exc}"
    return f"ok v{version} sum {float(state['w'].sum())}"


async def main(transports: list[str]) -> None:
    for transport in transports:
        server = WeightServer(transport, host="127.0.0.1", token=TOKEN)
        await server.start()
        source = await server.publish(3, {"w": np.ones(1000, dtype=np.float32)})
        result = {"transport": transport,
                  "without": await outcome(source, None),
                  "wrong": await outcome(source, bytes(32).hex()),
                  "with": await outcome(source, TOKEN.hex())}
        print(json.dumps(result), flush=True)
        await server.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
