"""Wire protocol shared by the agent and the controller (stdlib only).

Messages are single lines of JSON objects carrying a schema version (``v``) and a ``type``.
Both sides import this module so there is exactly one definition of the framing, the size
bound and the authentication digest. See docs/architecture.md for the message catalogue.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_NESTING = 64  # arrays and objects in a message: deeper, and re-encoding it could exhaust the stack
NONCE_BYTES = 32

AGENT_TO_CONTROLLER = frozenset(
    {"hello", "heartbeat", "worker_started", "worker_exited", "worker_phase", "fault_signal", "worker_msg", "ack"}
)
CONTROLLER_TO_AGENT = frozenset(
    {"challenge", "welcome", "reject", "ping", "start_worker", "stop_worker", "signal_worker", "inject", "to_worker",
     "shutdown"}
)


class ProtocolError(ValueError):
    """A message that is malformed, too large, of the wrong version or of an unknown type."""


def encode(message_type: str, **fields: Any) -> bytes:
    """Return one framed line for a message of ``message_type`` with ``fields``."""
    body = {"v": PROTOCOL_VERSION, "type": message_type, **fields}
    line = json.dumps(body, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message {message_type!r} is {len(line)} bytes, over the {MAX_MESSAGE_BYTES} byte bound")
    return line


def decode(line: bytes, allowed_types: frozenset[str]) -> dict[str, Any]:
    """Parse one framed line; raise ProtocolError unless it is a known message of this version."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {MAX_MESSAGE_BYTES} byte bound")
    body = loads_bounded(line)
    if not isinstance(body, dict):
        raise ProtocolError("message is not a JSON object")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"schema version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    message_type = body.get("type")
    if message_type not in allowed_types:
        raise ProtocolError(f"unknown message type {message_type!r}")
    return body


def loads_bounded(line: bytes | str) -> Any:
    """One JSON value whose arrays and objects nest at most ``MAX_NESTING`` deep; ProtocolError else."""
    try:
        value = json.loads(line)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python reads
        raise ProtocolError(f"not JSON: {str(exc)[:200]}") from None
    except RecursionError:  # arrays or objects nested deeper than the parser goes
        raise ProtocolError("not JSON this side can read: nested too deeply") from None
    if nesting(value) > MAX_NESTING:
        raise ProtocolError(f"nested deeper than {MAX_NESTING} levels")
    return value


class JsonLines:
    """A byte stream cut into JSON objects, one per line (the worker template's protocol): ``feed``
    gives the objects its chunk completes, None for a line that is not one bounded JSON object."""

    def __init__(self) -> None:
        self._pending = b""

    @property
    def pending_bytes(self) -> int:
        """Bytes of an unfinished line held back."""
        return len(self._pending)

    def feed(self, chunk: bytes) -> list[dict[str, Any] | None]:
        self._pending += chunk
        objects: list[dict[str, Any] | None] = []
        while b"\n" in self._pending:
            line, _, self._pending = self._pending.partition(b"\n")
            try:
                body = loads_bounded(line)
            except ProtocolError:
                body = None
            objects.append(body if isinstance(body, dict) else None)
        return objects


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar: 0), without recursion; counting
    stops past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def new_nonce() -> str:
    """A fresh random challenge, hex encoded."""
    return os.urandom(NONCE_BYTES).hex()


def auth_digest(secret: bytes, nonce: str, node: str) -> str:
    """The agent's answer to a challenge: HMAC-SHA256 over nonce and node name."""
    return hmac.new(secret, (nonce + node).encode(), hashlib.sha256).hexdigest()


WEIGHTS_TOKEN_ENV = "RLCTL_WEIGHTS_TOKEN"
# The GPUs (the node's local indices, comma-separated) a worker holds, as the controller placed it.
GPUS_ENV = "RLCTL_GPUS"
# The node's own CUDA_VISIBLE_DEVICES as the agent found it: a worker that regroups over other GPUs
# of the node (elastic rollout) maps their indices through it as the agent would (rlctl.worker.node_devices).
NODE_DEVICES_ENV = "RLCTL_NODE_DEVICES"
_WEIGHTS_PURPOSE = b"rlctl weights pull v1"


def weights_token(secret: bytes) -> str:
    """The job's weights token (hex) that the agent hands its workers: an HMAC of a fixed purpose
    under the job secret, so it proves membership of the job without being the agents' secret."""
    return hmac.new(secret, _WEIGHTS_PURPOSE, hashlib.sha256).hexdigest()


def verify_auth(secret: bytes, nonce: str, node: str, answer: object) -> bool:
    """Constant-time check of an agent's challenge answer."""
    if not isinstance(answer, str):
        return False
    return hmac.compare_digest(auth_digest(secret, nonce, node), answer)
