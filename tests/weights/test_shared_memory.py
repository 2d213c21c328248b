"""Same-node pulls through the holder's memory file (``rlctl.weights.transport_shm``).

Real memory files, real descriptor passing over a Unix socket, holders in this process and in a
spawned one; the copy-and-hash against the checksum's own definition; the fallbacks to the
transport (a version not in a memory file, another node, the option off); what a joiner is
refused (a wrong token), what it catches (bytes changed in the holder's memory) and what it can
not do (write into the holder's memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import weights_procs

from rlctl.weights import bundle as bundle_module
from rlctl.weights import checksum, transport_shm
from rlctl.weights.bundle import Bundle, flatten
from rlctl.weights.checksum import compute_checksum, copy_leaves
from rlctl.weights.client import fetch_bundle, fetch_bundle_sync, fetch_sync
from rlctl.weights.errors import WeightIntegrityError, WeightTransferError
from rlctl.weights.server import WeightServer, WeightServerThread
from rlctl.weights.staging import HostBufferPool, allocate_host, shared_region
from rlctl.weights.striping import fetch_striped_sync

CTX = mp.get_context("spawn")
TOKEN = b"t" * 32


def _state(seed: int, elements: int = 1 << 14) -> dict[str, Any]:
    return weights_procs.make_state(seed, elements)


def _equal(got: dict[str, Any], expected: dict[str, Any]) -> bool:
    return got.keys() == expected.keys() and all(
        got[name].dtype == t.dtype and bool((got[name] == t).all()) for name, t in expected.items())


@contextlib.contextmanager
def _serving(transport: str = "tcp", shared_memory: bool = True, **kwargs: Any) -> Iterator[WeightServerThread]:
    with WeightServerThread(transport, host="127.0.0.1", shared_memory=shared_memory, **kwargs) as server:
        yield server


# ---------------------------------------------------------------------------------------------
# memory files and the copy


def test_host_buffers_are_memory_files_and_views_find_their_place_in_them() -> None:
    host = allocate_host(3 * 4096, pin=False)
    whole = shared_region(host.view(3 * 4096))
    assert whole is not None and whole.offset == 0 and whole.fd == host.shared_fd
    inner = shared_region(host.array[4096:8192])
    assert inner is not None and inner.offset == 4096
    assert shared_region(np.zeros(4096, dtype=np.uint8)) is None  # not a memory file
    host.array[5] = 7
    assert os.pread(whole.fd, 8, 0)[5] == 7  # the file is the buffer's memory


@pytest.mark.parametrize("algorithm", ["xxh3_128-t64m", "sha256-t64m"])
def test_copy_leaves_copies_and_gives_the_checksum_of_what_landed(monkeypatch: pytest.MonkeyPatch,
                                                                    algorithm: str) -> None:
    pytest.importorskip("xxhash") if algorithm.startswith("xxh3") else None
    monkeypatch.setattr(checksum, "LEAF_BYTES", 4096)  # several leaves, the last one short
    monkeypatch.setattr(checksum, "COPY_PIECE_BYTES", 1000)  # several pieces a leaf, the last one short
    source = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    dest = np.zeros_like(source)
    landed = copy_leaves(source, dest, algorithm)
    assert np.array_equal(dest, source)
    assert landed == compute_checksum(source, algorithm)
    assert copy_leaves(source, np.zeros_like(source), None) is None  # no hashing asked for
    assert copy_leaves(source, np.zeros_like(source), algorithm.removesuffix("-t64m")) is None  # not a tree
    with pytest.raises(ValueError, match="copying"):
        copy_leaves(source, dest[:-1], algorithm)


# ---------------------------------------------------------------------------------------------
# pulls


def test_a_same_node_pull_copies_the_memory_file_and_hashes_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = bundle_module.compute_checksum
    monkeypatch.setattr(bundle_module, "compute_checksum", lambda buf, alg=None: hashed.append(buf.nbytes) or real(buf, alg))
    with _serving() as server:
        descriptor = server.publish(3, _state(1))
        assert isinstance(descriptor["shm_socket"], str)
        pulled = fetch_bundle_sync(descriptor, timeout=20.0, pool=HostBufferPool())
        assert pulled.pull is not None
        assert (pulled.pull.transport, pulled.pull.lane, pulled.pull.lanes) == ("shm", "sm", ("memfd/host",))
        assert pulled.pull.same_node
        assert hashed == []  # the checksum of what landed was made during the copy, not by a second pass
        assert np.array_equal(pulled.buffer, server.server.current_bundle().buffer)
        version, state = fetch_sync(descriptor, timeout=20.0)
        assert version == 3 and _equal(state, _state(1))


def test_a_pulled_version_is_served_on_from_the_joiners_own_memory_file() -> None:
    with _serving() as first, _serving() as second:
        pulled = fetch_bundle_sync(first.publish(4, _state(2)), timeout=20.0, pool=second.pool)
        again = second.publish_bundle(pulled)
        assert again["shm_socket"] != first.server.endpoint["shm_socket"]
        version, state = fetch_sync(again, timeout=20.0)
        assert version == 4 and _equal(state, _state(2))


def test_a_holder_in_another_process_hands_over_its_memory_file() -> None:
    out, (stop_reader, stop) = CTX.Queue(), CTX.Pipe(duplex=False)
    holder = CTX.Process(target=weights_procs.holder_main,
                         args=("tcp", 5, 9, 1 << 20, "normal", out, stop_reader), kwargs={"shared_memory": True})
    holder.start()
    try:
        descriptor = out.get(timeout=60)
        assert descriptor["self_fetch_ok"]
        pulled = fetch_bundle_sync(descriptor, timeout=30.0)
        assert pulled.pull is not None and pulled.pull.transport == "shm"
        version, state = fetch_sync(descriptor, timeout=30.0)
        assert version == 9 and _equal(state, _state(5, 1 << 20))
    finally:
        stop.send(True)
        holder.join(30)
    assert holder.exitcode == 0


def test_stripes_come_out_of_the_memory_files_of_several_holders() -> None:
    with _serving() as one, _serving() as two:
        state = _state(3, 1 << 16)
        sources = [one.publish(2, state), two.publish(2, state)]
        pulled = fetch_striped_sync(sources, timeout=20.0)
        assert pulled.pull is not None and pulled.pull.transport == "shm" and pulled.pull.holders == 2
        assert np.array_equal(pulled.buffer, one.server.current_bundle().buffer)


def test_bytes_changed_in_the_holders_memory_are_caught() -> None:
    with _serving() as server:
        descriptor = server.publish(1, _state(4))
        served = server.server.current_bundle()
        served.buffer[served.manifest.nbytes // 2] ^= 0x01
        with pytest.raises(WeightIntegrityError, match="received bytes hash"):
            fetch_bundle_sync(descriptor, timeout=20.0)


def test_the_joiner_gets_the_memory_file_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real = transport_shm.map_file

    def record(fd: int, offset: int, nbytes: int) -> Any:
        modes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        return real(fd, offset, nbytes)

    monkeypatch.setattr(transport_shm, "map_file", record)
    with _serving() as server:
        fetch_bundle_sync(server.publish(1, _state(5)), timeout=20.0)
    assert modes == [os.O_RDONLY]


def test_a_joiner_that_reopens_the_memory_file_cannot_write_resize_or_unseal_it() -> None:
    import mmap

    host = allocate_host(2 * 4096, pin=False)
    assert host.shared_fd is not None
    handed = os.open(f"/proc/self/fd/{host.shared_fd}", os.O_RDONLY)  # what a joiner is given
    reopened = os.open(f"/proc/self/fd/{handed}", os.O_RDWR)  # what a joiner could try with it
    try:
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"evil", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(reopened, 4096)  # a writable shared mapping
        with pytest.raises(PermissionError):
            os.ftruncate(reopened, 0)  # would give the holder SIGBUS on its next touch
        with pytest.raises(PermissionError):
            fcntl.fcntl(reopened, fcntl.F_ADD_SEALS, 0)  # sealed for good
        host.array[:4] = np.frombuffer(b"good", dtype=np.uint8)  # the holder's own mapping still writes
        assert os.pread(handed, 4, 0) == b"good"
    finally:
        os.close(reopened)
        os.close(handed)


def test_a_memory_file_that_cannot_be_sealed_is_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlctl.weights import staging

    real_fcntl = staging.fcntl.fcntl

    def old_kernel(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == staging.fcntl.F_ADD_SEALS:
            raise OSError(22, "Invalid argument")  # what a kernel before 5.1 answers to F_SEAL_FUTURE_WRITE
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(staging.fcntl, "fcntl", old_kernel)
    host = allocate_host(4096, pin=False)
    assert host.shared_fd is None and shared_region(host.view(4096)) is None
    host.array[:] = 3  # still an ordinary buffer
    with _serving() as server:
        pulled = fetch_bundle_sync(server.publish(1, _state(10)), timeout=20.0)
    assert pulled.pull is not None and pulled.pull.transport == "tcp"  # the transport took it


def test_a_stranger_is_refused_on_the_socket_as_on_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    async def pull() -> None:
        server = WeightServer("tcp", token=TOKEN, shared_memory=True)
        await server.start()
        try:
            descriptor = await server.publish(1, _state(6))
            monkeypatch.setenv("RLCTL_WEIGHTS_TOKEN", "00" * 32)
            with pytest.raises(WeightTransferError, match="refused"):
                await transport_shm.shm_receive(descriptor, asyncio.get_running_loop().time() + 10)
            assert server.admission().refused == 1
        finally:
            await server.close()

    asyncio.run(pull())


# ---------------------------------------------------------------------------------------------
# when the transport takes the pull


def test_a_version_not_in_a_memory_file_goes_over_the_transport(caplog: pytest.LogCaptureFixture) -> None:
    plain = flatten(_state(7), 5)
    outside = Bundle(plain.manifest, np.array(plain.buffer))  # an ordinary array: no memory file
    with _serving() as server, caplog.at_level(logging.INFO, logger="rlctl.weights.client"):
        descriptor = server.publish_bundle(outside)
        pulled = fetch_bundle_sync(descriptor, timeout=20.0)
    assert pulled.pull is not None and pulled.pull.transport == "tcp"
    assert "instead of shared memory" in caplog.text and transport_shm.NOT_SHARED in caplog.text


def test_another_node_a_gone_socket_or_the_option_off_go_over_the_transport() -> None:
    with _serving() as server:
        descriptor = server.publish(1, _state(8))
        elsewhere = fetch_bundle_sync({**descriptor, "node_id": "another-node"}, timeout=20.0)
        gone = fetch_bundle_sync({**descriptor, "shm_socket": "rlctl-weights-nobody"}, timeout=20.0)
    assert elsewhere.pull is not None and elsewhere.pull.transport == "tcp"
    assert gone.pull is not None and gone.pull.transport == "tcp"
    with _serving(shared_memory=False) as server:
        descriptor = server.publish(1, _state(8))
        assert "shm_socket" not in descriptor
        off = fetch_bundle_sync(descriptor, timeout=20.0)
    assert off.pull is not None and off.pull.transport == "tcp"


def test_a_holder_without_proc_or_a_joiner_that_cannot_map_goes_over_the_transport(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_open = os.open

    def no_proc(path: Any, flags: int, *args: Any) -> int:
        if str(path).startswith("/proc/self/fd/"):
            raise PermissionError(13, "Permission denied", str(path))  # a sandbox's /proc
        return real_open(path, flags, *args)

    with _serving() as server, caplog.at_level(logging.INFO, logger="rlctl.weights.client"):
        descriptor = server.publish(1, _state(11))
        with monkeypatch.context() as patched:
            patched.setattr(transport_shm.os, "open", no_proc)
            holder_refused = fetch_bundle_sync(descriptor, timeout=20.0)
        assert "no read-only descriptor of the memory file here" in caplog.text

        def no_room(*_args: Any) -> Any:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(transport_shm, "map_file", no_room)
        joiner_refused = fetch_bundle_sync(descriptor, timeout=20.0)
        assert "cannot be mapped here" in caplog.text
        after = fetch_sync(descriptor, timeout=20.0)  # the holder serves on
    for pulled in (holder_refused, joiner_refused):
        assert pulled.pull is not None and pulled.pull.transport == "tcp"
    assert after[0] == 1 and _equal(after[1], _state(11))


def test_an_async_pull_into_a_pool_holds_its_buffer_while_the_bundle_lives() -> None:
    async def pull() -> None:
        server = WeightServer("tcp", shared_memory=True)
        await server.start()
        pool = HostBufferPool()
        try:
            received = await fetch_bundle(await server.publish(1, _state(9)), timeout=20.0, pool=pool)
            assert pool.buffers[0].busy and not pool.has_free(received.manifest.nbytes)
            del received
            assert pool.has_free(1)
        finally:
            await server.close()

    asyncio.run(pull())


def test_a_pull_cancelled_while_it_copies_keeps_its_pooled_buffer_until_the_copy_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy runs on a thread, which a cancelled pull cannot stop: the pool must not hand the
    # buffer to the next pull while that thread still writes into it.
    import threading

    copying, release = threading.Event(), threading.Event()
    real = transport_shm.copy_out

    def slow_copy(*args: Any) -> Any:
        copying.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(transport_shm, "copy_out", slow_copy)

    async def pull() -> None:
        server = WeightServer("tcp", shared_memory=True)
        await server.start()
        pool = HostBufferPool(max_buffers=1)
        try:
            descriptor = await server.publish(1, _state(9))
            nbytes = int(descriptor["nbytes"])
            task = asyncio.ensure_future(fetch_bundle(descriptor, timeout=20.0, pool=pool))
            while not copying.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not pool.has_free(nbytes)  # the thread still copies into it
            release.set()
            for _ in range(500):
                if pool.has_free(nbytes):
                    break
                await asyncio.sleep(0.01)
            assert pool.has_free(nbytes)
        finally:
            release.set()
            await server.close()

    asyncio.run(pull())
