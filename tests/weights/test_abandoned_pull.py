"""A same-node (``ucx-sm``) pull that gives up leaves its landing buffer alone: once the pull has
returned, UCX writes nothing more into memory the caller may free or hand to the next pull.

Both cases with real UCX, holder and joiner each in its own process (one UCX context per process):

* the holder sends only after the joiner gave up (as one stopped between its reply and its send,
  then resumed, would): the joiner's receive is posted and unmatched when the pull ends, by its
  deadline or by being cancelled (the standby drops copies a newer version overtook). The joiner
  ends it itself (``ucx_tag_recv``), leaving nothing behind, and its worker pulls on as before.
* the holder is stopped half-way through the body: the receive is matched and cannot be
  cancelled, and UCX writes the rest when the holder goes on. Its buffer is kept (a fresh one
  referenced, a pooled one busy) until UCX ends the receive. Before ``ucx_tag_recv`` the pull
  dropped it, and those bytes landed in freed memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import weights_procs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (the 'ucx' extra) is not installed")

CTX = mp.get_context("spawn")
BIG = 4 << 20  # float32 elements: a 16 MiB body, sent with UCX's rendezvous protocol as real weights are


@contextlib.contextmanager
def _holder(mode: str) -> Iterator[dict[str, Any]]:
    queue, (stop_reader, stop) = CTX.Queue(), CTX.Pipe(duplex=False)
    process = CTX.Process(target=weights_procs.holder_main, args=("ucx-sm", 3, 5, BIG, mode, queue, stop_reader))
    process.start()
    try:
        yield queue.get(timeout=60)
    finally:
        with contextlib.suppress(OSError):
            stop.send(True)
        process.join(30)
        if process.is_alive():
            process.kill()


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    with _holder("late-send") as late, _holder("normal") as normal:
        out = CTX.Queue()
        joiner = CTX.Process(target=weights_procs.abandoning_joiner_main, args=(late, normal, out))
        joiner.start()
        try:
            return dict(out.get(timeout=120))
        finally:
            joiner.join(30)
            if joiner.is_alive():
                joiner.kill()


@pytest.mark.parametrize(("ends", "error"), [("deadline", "WeightTimeoutError"), ("cancelled", "CancelledError")])
def test_a_pull_that_gives_up_is_not_written_into_afterwards(report: dict[str, Any], ends: str, error: str) -> None:
    assert report[ends] == {"how": error, "at_return": 0, "later": 0}


def test_nothing_is_left_receiving_and_the_next_pull_gets_the_whole_version(report: dict[str, Any]) -> None:
    assert report["still_receiving"] == 0
    assert report["then"] == "received"


def test_a_receive_still_running_when_its_pull_gave_up_keeps_its_buffer_until_ucx_ends_it() -> None:
    # The holder is stopped (SIGSTOP: what a hung holder is) once its bytes start landing, so the
    # joiner's receive is matched and half done when the pull gives up at its deadline; the
    # holder then goes on. UCX writes the rest into the buffer: it must not have been freed
    # (fresh) or made free for the next pull (pooled, on the host or the device) meanwhile.
    stop_reader, stop = CTX.Pipe(duplex=False)
    ready, to_test, from_test = CTX.Queue(), CTX.Queue(), CTX.Queue()
    holder = CTX.Process(target=weights_procs.tcp_lane_holder_main, args=(512 << 20, ready, stop_reader))
    holder.start()
    joiner = None
    try:
        pid, source = ready.get(timeout=60)
        joiner = CTX.Process(target=weights_procs.stopped_mid_pull_joiner_main, args=(source, to_test, from_test))
        joiner.start()
        for _ in ("fresh", "pooled", "device"):
            assert to_test.get(timeout=60) == "started"
            os.kill(pid, signal.SIGSTOP)
            assert to_test.get(timeout=60) == "returned"
            os.kill(pid, signal.SIGCONT)
            from_test.put("resumed")
        report = to_test.get(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGCONT)
        with contextlib.suppress(OSError):
            stop.send(True)
        for process in (joiner, holder):
            if process is not None:
                process.join(30)
                if process.is_alive():
                    process.kill()
    assert report["fresh"] == {"how": "WeightTimeoutError", "partial": True, "receiving": 1, "kept": True,
                               "ended": True, "freed_after": True}
    for pooled in ("pooled", "device"):
        assert report[pooled] == {"how": "WeightTimeoutError", "partial": True, "busy": True, "ended": True,
                                  "free_after": True}
