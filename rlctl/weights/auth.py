"""Who may pull weights: the job's workers, proven by a token derived from the job secret.

Each node's agent derives the token from the job secret (``rlctl_agent.protocol.weights_token``)
and puts it in the environment of every worker it starts (``RLCTL_WEIGHTS_TOKEN``); a holder
serves a pull only when the request carries the same token (constant-time compare), on every
transport. A holder made without a token (a library user, a benchmark in one process) serves
anyone: a job's workers never do.
"""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "RLCTL_WEIGHTS_TOKEN"
TOKEN_BYTES = 32
REFUSED = "not authorized: this holder serves only the workers of its own job"


def job_token() -> bytes | None:
    """This process's token (from the environment), or None when it was given none."""
    text = os.environ.get(TOKEN_ENV, "")
    try:
        token = bytes.fromhex(text)
    except ValueError:
        return None
    return token if len(token) == TOKEN_BYTES else None


def authorized(expected: bytes | None, presented: object) -> bool:
    """Whether ``presented`` (hex string or raw bytes) matches ``expected``; True when no token is required."""
    if expected is None:
        return True
    if isinstance(presented, str):
        try:
            presented = bytes.fromhex(presented)
        except ValueError:
            return False
    return isinstance(presented, bytes) and hmac.compare_digest(expected, presented)
