"""Host staging: reused pool buffers (double buffering), the chunked copy, the tree checksum, and the
fallback to pageable memory when pinning is refused. In-process, CPU: the same code paths a GPU
holder runs, with host tensors."""

from __future__ import annotations

import gc
import hashlib
import logging

import numpy as np
import pytest
import torch
import xxhash

from rlctl.weights import checksum, flatten, staging, unflatten, verify
from rlctl.weights.bundle import ALIGNMENT, check_one_device
from rlctl.weights.checksum import LEAF_BYTES, LeafHasher, compute_checksum
from rlctl.weights.staging import HostBufferPool, allocate_host, stage


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 7, generator=gen), "bf16": torch.randn(5, 33, generator=gen).to(torch.bfloat16),
            "strided": torch.randn(9, 11, generator=gen).t(), "mask": torch.rand(13, generator=gen) > 0.5,
            "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5), "ids": np.arange(17, dtype=np.int64)}


def _same(rebuilt: dict[str, object], state: dict[str, object]) -> bool:
    return all(torch.equal(torch.as_tensor(rebuilt[name]), torch.as_tensor(value)) for name, value in state.items())


def test_a_pool_reuses_its_buffers_and_never_overwrites_one_a_live_bundle_is_on() -> None:
    pool = HostBufferPool(pin=False)
    assert not pool.has_free(1)
    first = flatten(_state(1), 1, pool=pool)
    second = flatten(_state(2), 2, pool=pool)  # the first is still served: a second buffer
    assert first.buffer.ctypes.data != second.buffer.ctypes.data and pool.allocations == 2
    assert not pool.has_free(1)  # both busy
    address = first.buffer.ctypes.data
    del first
    gc.collect()
    assert pool.has_free(first_bytes := second.manifest.nbytes) and not pool.has_free(10 * first_bytes + 2**20)
    third = flatten(_state(3), 3, pool=pool)  # the first buffer is free again: reused, not reallocated
    assert third.buffer.ctypes.data == address and pool.allocations == 2
    assert _same(unflatten(second.manifest, second.buffer), _state(2))
    assert _same(unflatten(third.manifest, third.buffer), _state(3))
    verify(third.manifest, third.buffer, 3, third.manifest.checksum)
    fourth = flatten(_state(4), 4, pool=pool)  # two alive: a third pooled buffer
    fifth = flatten(_state(5), 5, pool=pool)  # three alive and the pool is full: a one-off buffer
    assert len(pool.buffers) == staging.MAX_POOLED_BUFFERS and pool.allocations == 4
    for bundle, seed in ((second, 2), (third, 3), (fourth, 4), (fifth, 5)):
        assert _same(unflatten(bundle.manifest, bundle.buffer), _state(seed))


def test_a_reused_dirty_buffer_gives_the_same_bytes_and_checksum_as_a_fresh_one() -> None:
    pool = HostBufferPool(pin=False)
    with pool.reserve(1 << 16) as host:
        host.array[:] = 0xAB  # garbage where the alignment gaps will be
    pooled = flatten(_state(7), 7, pool=pool)
    fresh = flatten(_state(7), 7)
    assert pooled.buffer.ctypes.data == pool.buffers[0].array.ctypes.data
    assert np.array_equal(pooled.buffer, fresh.buffer) and pooled.manifest.checksum == fresh.manifest.checksum
    assert pooled.staging is not None and pooled.staging.device == "cpu" and pooled.staging.nbytes == pooled.manifest.nbytes


def test_the_chunked_copy_cuts_tensors_at_chunk_boundaries_and_hashes_each_chunk_as_it_lands() -> None:
    state = _state(11)
    reference = flatten(state, 1)
    dest = np.full(reference.manifest.nbytes, 0x5A, dtype=np.uint8)
    hasher = LeafHasher("xxh3_128", dest)
    stats = stage(state, reference.manifest.tensors, dest, hasher, pinned=False, chunk_bytes=4 * ALIGNMENT)
    assert np.array_equal(dest, reference.buffer)
    assert stats.chunks > len(state)  # the big tensors were cut into several chunks
    assert hasher.checksum() == compute_checksum(dest, "xxh3_128")


def test_the_tree_checksum_is_the_hash_of_its_64_mib_leaf_hashes() -> None:
    buffer = np.frombuffer(np.random.default_rng(0).bytes(LEAF_BYTES + 1000), dtype=np.uint8)
    leaves = [bytes(buffer[:LEAF_BYTES]), bytes(buffer[LEAF_BYTES:])]
    xxh = xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(leaf) for leaf in leaves))
    sha = hashlib.sha256(b"".join(hashlib.sha256(leaf).digest() for leaf in leaves)).hexdigest()
    assert compute_checksum(buffer, "xxh3_128-t64m") == f"xxh3_128-t64m:{xxh}"
    assert compute_checksum(buffer, "sha256-t64m") == f"sha256-t64m:{sha}"
    assert checksum.default_checksum_algorithm() == "xxh3_128-t64m"  # xxhash is installed here
    empty = np.empty(0, dtype=np.uint8)
    assert compute_checksum(empty, "sha256-t64m") == "sha256-t64m:" + hashlib.sha256(b"").hexdigest()


def test_when_pinning_is_refused_staging_falls_back_to_pageable_memory_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(staging, "_warned_pageable", False)
    caplog.set_level(logging.WARNING, logger="rlctl.weights.staging")

    def refuse(address: int, length: int) -> None:
        raise RuntimeError("cudaHostRegister failed with cudaError 2 (out of memory: ulimit -l)")

    pools = [HostBufferPool(pin=True, register=refuse) for _ in range(2)]
    bundles = [flatten(_state(seed), seed, pool=pool) for seed, pool in enumerate(pools)]
    assert all(not buffer.pinned for pool in pools for buffer in pool.buffers)
    assert all(b.staging is not None and not b.staging.pinned for b in bundles)
    for seed, bundle in enumerate(bundles):
        assert _same(unflatten(bundle.manifest, bundle.buffer), _state(seed))
    warnings = [r for r in caplog.records if "pageable" in r.getMessage()]
    assert len(warnings) == 1 and "ulimit -l" in warnings[0].getMessage()
    # This machine's torch has no CUDA: the real registration fails the same way, and never crashes.
    assert not allocate_host(4096, pin=True).pinned


def test_a_pool_pins_through_the_registrar_and_unpins_what_it_frees() -> None:
    registered: dict[int, int] = {}
    pool = HostBufferPool(pin=True, register=registered.__setitem__, unregister=registered.pop)
    bundle = flatten(_state(3), 3, pool=pool)
    assert bundle.staging is not None and bundle.staging.pinned
    assert registered == {pool.buffers[0].array.ctypes.data: pool.buffers[0].capacity}
    del bundle, pool
    gc.collect()
    assert registered == {}


def test_a_state_on_two_devices_is_refused_naming_the_tensor_and_nothing_is_staged() -> None:
    pool = HostBufferPool(pin=False)
    mixed = {"a": torch.zeros(4), "b": torch.zeros(4, device="meta")}
    with pytest.raises(ValueError, match="tensor 'b' is on meta but tensor 'a' is on cpu"):
        flatten(mixed, 1, pool=pool)
    with pytest.raises(ValueError, match="tensor 'w' is on the meta device"):
        check_one_device({"w": torch.zeros(2, device="meta")})
    assert pool.allocations == 0


def test_the_pinning_call_runs_on_a_thread_of_its_own_on_the_callers_device_and_its_refusal_is_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    # A refused cudaHostRegister leaves its error as its thread's last CUDA error, which torch's
    # next kernel launch there would raise: the call must not run on the staging thread.
    # That thread registers from the caller's device (a fresh thread's is 0): a process working
    # on GPU 1 must not open a context on GPU 0.
    threads: list[str] = []
    current_device = threading.local()

    class Runtime:
        @staticmethod
        def cudaHostRegister(address: int, length: int, flags: int) -> int:
            threads.append(threading.current_thread().name)
            registered_from.append(getattr(current_device, "index", 0))
            return 2  # cudaErrorMemoryAllocation

    registered_from: list[int] = []
    current_device.index = 1
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current_device, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(current_device, "index", index))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4096 bytes failed with cudaError 2"):
        staging._cuda_register(1234, 4096)
    assert len(threads) == 1 and threads[0] != threading.current_thread().name and threads[0].startswith("rlctl-pin")
    assert registered_from == [1]


def test_a_gpu_states_buffer_is_reserved_with_its_gpu_current_and_a_host_states_with_nothing_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    from collections.abc import Iterator

    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device(index: torch.device) -> Iterator[None]:
        entered.append(index)
        yield

    class OnSecondGpu:
        device = torch.device("cuda:1")

    monkeypatch.setattr(torch.cuda, "device", device)
    with staging.on_source_device({"w": OnSecondGpu()}):
        assert entered == [torch.device("cuda:1")]
    with staging.on_source_device(_state(1)):
        pass
    assert entered == [torch.device("cuda:1")]


def test_a_view_finds_the_pooled_buffer_it_lies_in_host_or_device() -> None:
    from rlctl.weights.device_bundle import DeviceBufferPool

    host_pool, device_pool = HostBufferPool(pin=False), DeviceBufferPool("cpu")  # the CPU twin of a GPU's
    with host_pool.reserve(1 << 16) as host, device_pool.reserve(1 << 16) as device:
        view = host.view(1 << 16)[100:200]
        assert staging.pooled_buffer_of(int(view.ctypes.data), view.nbytes) == (host, 100)
        assert staging.host_buffer_of(view) == (host, 100)
        tensor = device.view(1 << 16)[300:400]
        assert staging.pooled_buffer_of(tensor.data_ptr(), 100) == (device, 300)
        assert staging.pooled_buffer_of(int(view.ctypes.data), 1 << 16) is None  # runs past the buffer's end
    assert staging.pooled_buffer_of(int(np.zeros(8).ctypes.data), 8) is None
