"""A stranger that reaches a job's weight holder holds almost nothing there, on every transport.

Against real holder processes made with a job's token: strangers connect to the holder's port,
announce a 64 MiB frame and send nothing more (issue 30's repro). The holder must allocate nothing
for them, give them no serving slot (a joiner is served during the flood though every slot would
be taken), close each within a few seconds, and keep at most `MAX_UNAUTHENTICATED` of them at once.
On the UCX listener, which binds every interface, the same strangers never finish UCX's handshake;
a UCX peer that finishes it but never sends the token is closed too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Self

import pytest
import weights_procs

from rlctl.weights.admission import HANDSHAKE_TIMEOUT_S, MAX_UNAUTHENTICATED
from rlctl.weights.ucx_guard import SWEEP_PERIOD_S

CTX = mp.get_context("spawn")
HAS_UCXX = importlib.util.find_spec("ucxx") is not None
needs_ucxx = pytest.mark.skipif(not HAS_UCXX, reason="ucxx (the 'ucx' extra) is not installed")
ALL_TRANSPORTS = ["tcp", pytest.param("ucx", marks=needs_ucxx), pytest.param("ucx-sm", marks=needs_ucxx)]
TOKEN_HEX = bytes(range(32)).hex()
MAX_CONCURRENT = 4  # the holder's serving slots: fewer than the strangers, so any they held would starve the joiner
STRANGERS = 16
ANNOUNCE_64_MIB = (64 * 2**20 - 1).to_bytes(4, "big")
FLOOD_S = HANDSHAKE_TIMEOUT_S + 5.0
# How long a stranger may stay: the deadline, plus (UCX listener) up to two sweeps and the flood's polling.
LONGEST_HOLD_S = HANDSHAKE_TIMEOUT_S + 2 * SWEEP_PERIOD_S + 1.0
PROCESS_WAIT_S = 60.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class GuardedHolder:
    """A job's holder in its own process (``weights_procs.guarded_holder_main``)."""

    def __init__(self, transport: str) -> None:
        self._commands, child = CTX.Pipe()
        self.process = CTX.Process(target=weights_procs.guarded_holder_main,
                                   args=(transport, TOKEN_HEX, MAX_CONCURRENT, child))
        self.process.start()
        if not self._commands.poll(PROCESS_WAIT_S):
            raise AssertionError("the holder did not start")
        self.source: dict[str, Any] = self._commands.recv()
        self.address = (self.source["host"], int(self.source["port"]))

    def admission(self) -> dict[str, int]:
        self._commands.send("admission")
        return self._commands.recv()

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._commands.send("stop")
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@contextlib.contextmanager
def guarded_holder(transport: str) -> Any:
    holder = GuardedHolder(transport)
    try:
        yield holder
    finally:
        holder.stop()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the holder closed ``sock`` (a blocking socket: this call does not wait)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


class Flood:
    """``count`` strangers on ``address``, each announcing a 64 MiB frame and sending nothing more.
    With ``replace``, one the holder closes is replaced at once. ``holds``: how long each closed
    one stayed open."""

    def __init__(self, address: tuple[str, int], count: int, replace: bool = True) -> None:
        self._address = address
        self._replace = replace
        self._open: list[tuple[socket.socket, float]] = [self._connect() for _ in range(count)]
        self.holds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _connect(self) -> tuple[socket.socket, float]:
        sock = socket.create_connection(self._address, timeout=5.0)
        sock.settimeout(None)
        sock.sendall(ANNOUNCE_64_MIB)
        return sock, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            still_open = []
            for sock, opened in self._open:
                if closed_by_peer(sock):
                    self.holds.append(time.monotonic() - opened)
                    sock.close()
                    if self._replace:
                        still_open.append(self._connect())
                else:
                    still_open.append((sock, opened))
            self._open = still_open

    def oldest_open_s(self) -> float:
        return max((time.monotonic() - opened for _, opened in self._open), default=0.0)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        for sock, _ in self._open:
            sock.close()


def start_fetch(transport: str, source: dict[str, Any], timeout: float) -> tuple[Any, Any]:
    out = CTX.Queue()
    process = CTX.Process(target=weights_procs.fetch_once_main, args=(transport, source, TOKEN_HEX, timeout, out))
    process.start()
    return process, out


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_strangers_hold_no_memory_and_no_slot_and_are_closed_within_seconds(transport: str) -> None:
    with guarded_holder(transport) as holder:
        rss_before, descriptors_before = rss_bytes(holder.process.pid), holder.descriptors()
        peak = rss_before
        with Flood(holder.address, STRANGERS) as flood:
            joiner, result = start_fetch(transport, holder.source, timeout=10.0)
            flood_ends = time.monotonic() + FLOOD_S
            while time.monotonic() < flood_ends:
                peak = max(peak, rss_bytes(holder.process.pid))
                time.sleep(0.1)
            fetched = result.get(timeout=PROCESS_WAIT_S)
            joiner.join(10)
            oldest_open_s = flood.oldest_open_s()
        time.sleep(LONGEST_HOLD_S - HANDSHAKE_TIMEOUT_S)
        counts = holder.admission()
        descriptors_after = holder.descriptors()
    assert peak - rss_before < 16 * 2**20, f"the holder grew by {(peak - rss_before) / 2**20:.0f} MiB for {STRANGERS} strangers"
    assert fetched["ok"], f"the joiner was not served during the flood: {fetched}"
    assert len(flood.holds) >= STRANGERS, f"only {len(flood.holds)} strangers were closed in {FLOOD_S:.0f} s"
    assert max(flood.holds) <= LONGEST_HOLD_S, f"a stranger stayed {max(flood.holds):.1f} s"
    assert oldest_open_s <= LONGEST_HOLD_S
    assert descriptors_after <= descriptors_before + 2, (descriptors_before, descriptors_after)
    if transport == "ucx":
        assert counts["before_handshake_closed"] >= STRANGERS, counts
    else:
        assert counts["timed_out"] >= STRANGERS and counts["refused"] == 0, counts
        assert counts["waiting"] == 0, counts


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_strangers_beyond_the_cap_are_closed_at_once(transport: str) -> None:
    """Each stranger beyond the cap is closed when a newer one arrives, not when its handshake
    deadline passes. The framed holders (tcp, ucx-sm) count evictions apart from timeouts, so the
    count proves it, however slowly a holder sharing two busy cores accepts 72 connections (the
    eviction is counted before the socket is closed: the test waits for the closes). The UCX
    listener's guard counts both as one, so there a stranger closed before any handshake
    deadline could have passed is the proof."""
    extra = 8
    with guarded_holder(transport) as holder:
        flooded = time.monotonic()  # no stranger was accepted before this
        with Flood(holder.address, MAX_UNAUTHENTICATED + extra, replace=False) as flood:
            # Less the flood's 50 ms polling, with room.
            wait_until = flooded + (HANDSHAKE_TIMEOUT_S - 0.5 if transport == "ucx" else PROCESS_WAIT_S)
            while len(flood.holds) < extra and time.monotonic() < wait_until:
                time.sleep(0.05)
            closed_early = len(flood.holds)
            counts = holder.admission()
    assert closed_early >= extra, f"{closed_early} of {MAX_UNAUTHENTICATED + extra} strangers closed, want {extra}; {counts}"
    if transport == "ucx":
        assert counts["before_handshake_closed"] >= extra and counts["before_handshake_waiting"] <= MAX_UNAUTHENTICATED
    else:
        assert counts["evicted"] >= extra and counts["waiting"] <= MAX_UNAUTHENTICATED, counts


@needs_ucxx
def test_a_ucx_peer_that_never_sends_the_token_is_closed_within_the_handshake_deadline() -> None:
    with guarded_holder("ucx") as holder:
        out = CTX.Queue()
        peer = CTX.Process(target=weights_procs.silent_ucx_endpoint_main,
                           args=(holder.source, HANDSHAKE_TIMEOUT_S + 10.0, out))
        peer.start()
        closed_after = out.get(timeout=PROCESS_WAIT_S)
        peer.join(10)
        counts = holder.admission()
    assert closed_after is not None, "the holder kept a UCX endpoint that never sent its token"
    assert closed_after <= HANDSHAKE_TIMEOUT_S + 2.0
    assert counts["timed_out"] == 1, counts
