"""Weight transfer over the real transports, holder and joiners in separate spawned processes.

Covers: round trip of real tensors over TCP, UCX (tcp) and UCX shared memory; corruption on
the wire and in the holder's memory; version and checksum mismatch against the descriptor;
concurrent joiners; a holder that dies mid-transfer or hangs gives a clean error within the
timeout. UCX cases are skipped when ucxx cannot be imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import weights_procs

CTX = mp.get_context("spawn")
HAS_UCXX = importlib.util.find_spec("ucxx") is not None
needs_ucxx = pytest.mark.skipif(not HAS_UCXX, reason="ucxx (the 'ucx' extra) is not installed")
ALL_TRANSPORTS = ["tcp", pytest.param("ucx", marks=needs_ucxx), pytest.param("ucx-sm", marks=needs_ucxx)]
SMALL = 1 << 12
LARGE = 16 << 20  # 64 MiB of float32: long enough to die in the middle of
PROCESS_WAIT_S = 40.0


@contextlib.contextmanager
def holder(transport: str, seed: int = 1, version: int = 7, big: int = SMALL, mode: str = "normal") -> Iterator[
        tuple[dict[str, Any], Any]]:
    """A holder process; yields its source descriptor and the process handle."""
    queue = CTX.Queue()
    stop_reader, stop = CTX.Pipe(duplex=False)  # a pipe, not an Event: the holder may die while waiting
    process = CTX.Process(target=weights_procs.holder_main, args=(transport, seed, version, big, mode, queue,
                                                                        stop_reader))
    process.start()
    try:
        yield queue.get(timeout=PROCESS_WAIT_S), process
    finally:
        with contextlib.suppress(OSError):
            stop.send(True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def start_joiner(transport: str, sources: list[dict[str, Any]], seed: int = 1, big: int = SMALL,
                 timeout: float = 20.0) -> tuple[Any, Any]:
    queue = CTX.Queue()
    process = CTX.Process(target=weights_procs.joiner_main, args=(transport, sources, seed, big, timeout, queue))
    process.start()
    return process, queue


def joiner_results(process: Any, queue: Any) -> list[dict[str, Any]]:
    results = queue.get(timeout=PROCESS_WAIT_S)
    process.join(10)
    return results


def run_joiner(transport: str, sources: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
    return joiner_results(*start_joiner(transport, sources, **kwargs))


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_round_trip_of_real_tensors(transport: str) -> None:
    with holder(transport, seed=3, version=11, big=1 << 20) as (source, _):
        assert source["transport"] == transport and source["version"] == 11
        assert (transport != "tcp") == ("worker_address_hex" in source)
        [result] = run_joiner(transport, [source], seed=3, big=1 << 20)
    assert result["ok"], result
    assert result["version"] == 11


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_concurrent_joiners_all_get_identical_weights(transport: str) -> None:
    with holder(transport, seed=5, big=1 << 20) as (source, _):
        joiners = [start_joiner(transport, [source, source], seed=5, big=1 << 20) for _ in range(2)]
        results = [r for joiner in joiners for r in joiner_results(*joiner)]
    assert len(results) == 4
    assert all(r["ok"] for r in results), results


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_descriptor_mismatch_is_an_integrity_error(transport: str) -> None:
    with holder(transport) as (source, _):
        stale_version = {**source, "version": source["version"] + 1}
        wrong_checksum = {**source, "checksum": "sha256:" + "0" * 64}
        results = run_joiner(transport, [stale_version, wrong_checksum])
    assert [r.get("error") for r in results] == ["WeightIntegrityError"] * 2, results
    assert "version mismatch" in results[0]["message"]
    assert "checksum mismatch" in results[1]["message"]


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx-sm", marks=needs_ucxx)])
def test_corrupted_holder_memory_is_detected(transport: str) -> None:
    with holder(transport, mode="corrupt") as (source, _):
        [result] = run_joiner(transport, [source])
    assert result["error"] == "WeightIntegrityError", result
    assert "received bytes hash to" in result["message"]


class ByteFlippingProxy:
    """A TCP proxy that forwards holder→joiner traffic with one bit flipped at byte `flip_at`."""

    def __init__(self, target: tuple[str, int], flip_at: int) -> None:
        self.target, self.flip_at = target, flip_at
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> ByteFlippingProxy:
        self.thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop).result()
        self.port = server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pump(reader, up_writer, None), self._pump(up_reader, writer, self.flip_at))

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip_at: int | None) -> None:
        seen = 0
        while chunk := await reader.read(1 << 16):
            if flip_at is not None and seen <= flip_at < seen + len(chunk):
                data = bytearray(chunk)
                data[flip_at - seen] ^= 0x10
                chunk = bytes(data)
            seen += len(chunk)
            writer.write(chunk)
            await writer.drain()
        writer.close()


def test_byte_corrupted_on_the_wire_is_detected() -> None:
    with holder("tcp", big=1 << 18) as (source, _):
        with ByteFlippingProxy((source["host"], source["port"]), flip_at=source["nbytes"] // 2) as proxy:
            [result] = run_joiner("tcp", [{**source, "port": proxy.port}], big=1 << 18)
    assert result["error"] == "WeightIntegrityError", result
    assert "received bytes hash to" in result["message"]


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_holder_dying_mid_transfer_gives_a_clean_error(transport: str) -> None:
    timeout = 15.0
    with holder(transport, big=LARGE, mode="die") as (source, process):
        [result] = run_joiner(transport, [source], big=LARGE, timeout=timeout)
        process.join(10)
        assert process.exitcode == 1, "the holder should have died during the transfer"
    assert result["error"] == "WeightTransferError", result
    assert result["elapsed"] < timeout, result


def test_hung_holder_times_out() -> None:
    timeout = 2.0
    with holder("tcp", big=LARGE) as (source, process):
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        [result] = run_joiner("tcp", [source], big=LARGE, timeout=timeout)
        wall = time.monotonic() - started
    assert result["error"] == "WeightTransferError" and "timed out" in result["message"], result
    assert timeout <= result["elapsed"] < timeout + 1.5, result
    assert wall < PROCESS_WAIT_S


def test_unreachable_holder_is_a_transfer_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    from rlctl.weights import WeightTransferError, fetch_sync

    source = {"transport": "tcp", "host": "127.0.0.1", "port": free_port, "version": 1, "nbytes": 0,
              "checksum": "sha256:" + "0" * 64}
    with pytest.raises(WeightTransferError):
        fetch_sync(source, timeout=2.0)
