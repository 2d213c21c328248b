"""The virtual clock: a heap of timestamped callbacks. No real sleeping anywhere.

``schedule`` is O(log n); ties run in scheduling order, so a run is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    """A discrete-event loop over virtual seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._counter = itertools.count()
        self.processed = 0

    def schedule(self, at: float, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` at virtual time ``at`` (never before now)."""
        heapq.heappush(self._heap, (max(at, self.now), next(self._counter), callback, args))

    def after(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        self.schedule(self.now + max(0.0, delay), callback, *args)

    def run(self, until: float, stop: Callable[[], bool]) -> None:
        """Pop and run callbacks in time order until the heap is empty, ``until`` or ``stop()``."""
        while self._heap and not stop():
            at, _, callback, args = self._heap[0]
            if at > until:
                break
            heapq.heappop(self._heap)
            self.now = at
            self.processed += 1
            callback(*args)

    def __len__(self) -> int:
        return len(self._heap)
