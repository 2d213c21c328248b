"""The replies to worker requests, kept so that a request re-sent with the same id (its reply was
lost, or late) gets the first answer again instead of running twice.

A reply is kept for ``keep_s`` after it was last asked for, whatever the count: a worker re-sends an
unanswered request every attempt timeout (at most ``rlctl.worker``'s 30 s default, far below
``keep_s``), so a request that can still be retried is never forgotten. Memory is bounded by the
request rate times ``keep_s``, not by a count that would forget the newest replies all at once."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

REPLY_KEEP_S = 600.0

ReplyKey = tuple[str, str]  # (worker id, request id)


class ReplyCache:
    """Replies by (worker id, request id), least recently asked first."""

    def __init__(self, keep_s: float = REPLY_KEEP_S) -> None:
        self.keep_s = keep_s
        self._replies: OrderedDict[ReplyKey, tuple[float, dict[str, Any]]] = OrderedDict()

    def get(self, key: ReplyKey, now: float) -> dict[str, Any] | None:
        """The reply already given to ``key``, which counts as asked for again at ``now``."""
        found = self._replies.get(key)
        if found is None:
            return None
        self._replies[key] = (now, found[1])
        self._replies.move_to_end(key)
        return found[1]

    def put(self, key: ReplyKey, reply: dict[str, Any], now: float) -> None:
        self._replies[key] = (now, reply)
        self._replies.move_to_end(key)
        self._forget_older_than(now - self.keep_s)

    def _forget_older_than(self, cutoff: float) -> None:
        while self._replies:
            key, (asked_at, _) = next(iter(self._replies.items()))
            if asked_at >= cutoff:
                return
            del self._replies[key]

    def __len__(self) -> int:
        return len(self._replies)
