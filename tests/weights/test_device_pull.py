"""Pulls device to device: a holder keeps the version in device memory, a joiner receives it into
device memory of its own and checks it there (``rlctl.weights.device_bundle``).

On this machine the device is the CPU (the CPU twin): the same publish, request, UCX send and
receive, and fingerprint check as on a GPU, where UCX carries the bytes over ``cuda_ipc`` (one
node) or GPUDirect RDMA. The GPU check's ``weights_pull_local`` runs the real one.
Real processes: the holder and the joiner are spawned, each with its own UCX worker.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from typing import Any

import pytest
import torch
import weights_procs

from rlctl.weights import WeightServerThread, fetch_device_bundle_sync, flatten
from rlctl.weights.device_bundle import DeviceBufferPool, check_fingerprint, fingerprint, flatten_on_device
from rlctl.weights.errors import TransportUnavailableError, WeightIntegrityError

CTX = mp.get_context("spawn")
needs_ucxx = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (the 'ucx' extra) is not installed")
WAIT_S = 90.0


def _reference_fingerprint(data: bytes, block_words: int = 4096) -> str:
    """The definition, in plain Python: the bytes as zero-padded little-endian 64-bit words, summed
    per block, and the block sums added plain and weighted by position (from 1), mod 2**64."""
    block = 8 * block_words
    padded = data + b"\0" * (-len(data) % block)
    sums = [sum(int.from_bytes(padded[at + i:at + i + 8], "little", signed=True) for i in range(0, block, 8))
            for at in range(0, len(padded), block)]
    plain = sum(sums) % 2**64
    weighted = sum((b + 1) * total for b, total in enumerate(sums)) % 2**64
    return f"bs64:{len(data)}:{plain:016x}:{weighted:016x}"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 4096, 40_003, 3 * 32768, 3 * 32768 + 5])
def test_the_fingerprint_is_its_definition_with_whole_and_partial_blocks(nbytes: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert fingerprint(data) == _reference_fingerprint(bytes(data.numpy()))
    monkeypatch.setattr("rlctl.weights.device_bundle.FINGERPRINT_BLOCK_WORDS", 3)
    assert fingerprint(data) == _reference_fingerprint(bytes(data.numpy()), block_words=3)


def test_the_fingerprint_sums_wrap_mod_two_to_the_64() -> None:
    data = torch.full((5 * 32768,), 0xFF, dtype=torch.uint8)  # every word -1: block sums far from zero
    data[::8] = 0x7F
    assert fingerprint(data) == _reference_fingerprint(bytes(data.numpy()))


def test_the_fingerprint_catches_a_flipped_bit_shifted_bytes_a_shorter_buffer_and_blocks_out_of_place() -> None:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = fingerprint(data)
    flipped = data.clone()
    flipped[1000] ^= 0x04
    moved = torch.cat([data[3:], data[:3]])  # the bytes shifted
    blocks = torch.randint(0, 256, (4 * 32768,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    swapped = torch.cat([blocks[32768:65536], blocks[:32768], blocks[65536:]])
    assert fingerprint(flipped) != base and fingerprint(data[:-1]) != base and fingerprint(moved) != base
    assert fingerprint(swapped) != fingerprint(blocks)
    with pytest.raises(WeightIntegrityError, match="promised"):
        check_fingerprint(flipped, base, "version 3")


def test_the_device_copy_has_the_host_bundles_bytes_and_its_buffer_is_reused_once_released() -> None:
    state = weights_procs.make_state(4)
    bundle = flatten(state, 5)
    pool = DeviceBufferPool("cpu")
    on_device = flatten_on_device(bundle.manifest, state, pool)
    assert bytes(on_device.flat.numpy()) == bytes(bundle.buffer)  # the alignment gaps zeroed the same way
    assert on_device.fingerprint == _reference_fingerprint(bytes(bundle.buffer))
    for name, tensor in on_device.tensors().items():
        assert torch.equal(tensor, state[name]) and tensor.dtype == state[name].dtype
    assert pool.buffers[0].busy
    del on_device
    again = flatten_on_device(bundle.manifest, weights_procs.make_state(4), pool)
    assert pool.allocations == 1 and again.fingerprint == _reference_fingerprint(bytes(bundle.buffer))


def test_a_device_copy_is_refused_over_tcp_and_a_source_without_one_is_not_pulled_into_device_memory() -> None:
    import numpy as np

    with WeightServerThread(transport="tcp", checksum_algorithm=None) as server:
        with pytest.raises(ValueError, match="not over this server's 'tcp'"):
            server.publish(1, weights_procs.make_state(1), device_copy=True)
        state = weights_procs.make_state(1)
        with pytest.raises(ValueError, match="not over this server's 'tcp'"):
            server.publish_device_bundle(flatten_on_device(flatten(state, 1).manifest, state, DeviceBufferPool("cpu")))
        descriptor = server.publish(1, {"w": np.ones(4, dtype=np.float32)})
    assert "device_fingerprint" not in descriptor
    with pytest.raises(TransportUnavailableError, match="offers no copy in device memory"):
        fetch_device_bundle_sync(descriptor, DeviceBufferPool("cpu"))


def _serve(transport: str, mode: str = "normal") -> tuple[Any, Any, dict[str, Any]]:
    queue, (stop_reader, stop) = CTX.Queue(), CTX.Pipe(duplex=False)
    holder = CTX.Process(target=weights_procs.device_holder_main, args=(transport, 2, mode, queue, stop_reader))
    holder.start()
    return holder, stop, queue.get(timeout=WAIT_S)


@needs_ucxx
@pytest.mark.timeout(240)
def test_a_joiner_pulls_the_holders_device_copy_into_its_own_device_memory_and_checks_it_there() -> None:
    ucx_holder, ucx_stop, source = _serve("ucx")
    corrupt_holder, corrupt_stop, corrupt_source = _serve("ucx", "corrupt-device")
    try:
        assert source["device"] == "cpu" and source["device_fingerprint"].startswith("bs64:")
        listener_only = {k: v for k, v in source.items() if k != "sm_port"}
        promised_otherwise = {**source, "device_fingerprint": _reference_fingerprint(b"other")}
        queue = CTX.Queue()
        joiner = CTX.Process(target=weights_procs.device_joiner_main, args=(
            {"same-node": source, "listener": listener_only, "again": source, "corrupt": corrupt_source,
             "wrong-promise": promised_otherwise}, 2, queue))
        joiner.start()
        records = queue.get(timeout=WAIT_S)
        joiner.join(30)
    finally:
        for holder, stop in ((ucx_holder, ucx_stop), (corrupt_holder, corrupt_stop)):
            stop.send(True)
            holder.join(30)
    for name in ("same-node", "listener", "again"):
        record = records[name]
        assert record["ok"] and record["same"] and record["device"] == "cpu" and record["views_pool"], (name, record)
    assert records["same-node"]["transport"] == "ucx-sm" and records["same-node"]["lane"] == "sm"
    assert records["listener"]["transport"] == "ucx" and records["listener"]["lane"] in ("tcp", "sm")
    assert records["pool"]["allocations"] == 1  # each bundle dropped before the next pull: one buffer reused
    for name in ("corrupt", "wrong-promise"):
        assert records[name] == {"ok": False, "error": "WeightIntegrityError", "message": records[name]["message"]}
        assert "fingerprint" in records[name]["message"], records[name]
    assert records["host"]["ok"] and records["host"]["same"]  # joiners without the lane pull the host bundle
    assert records["served-on"] == {"host_same": True, "checksum": True, "fingerprint": True, "host_bundle": False}


def test_the_device_memory_decision_by_mode_device_transport_capability_and_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rlctl.weights import device_memory
    from rlctl.weights.device_memory import GpuMemory, carries_cuda_memory, keep_in_device_memory, room_for_copy
    from rlctl.weights.staging import HostBufferPool

    assert keep_in_device_memory("on", "cpu", "ucx", 10) and keep_in_device_memory("on", "cuda:0", "ucx-sm", 10)
    assert not keep_in_device_memory("on", "cpu", "tcp", 10)  # rlctl's tcp sends host bytes only
    assert not keep_in_device_memory("on", None, "ucx", 10)  # a state without torch tensors
    assert not keep_in_device_memory("off", "cuda:0", "ucx", 10)
    assert not keep_in_device_memory("auto", "cpu", "ucx", 10)  # auto: CUDA devices only
    with pytest.raises(ValueError, match="device_memory is one of"):
        keep_in_device_memory("always", "cpu", "ucx", 10)
    monkeypatch.setattr(device_memory, "_ucx_carries_cuda_memory", lambda: True)
    memory = GpuMemory(free=1_100, reserved=0, peak_allocated=0)
    monkeypatch.setattr(device_memory, "_gpu_memory", lambda device: memory)
    assert keep_in_device_memory("auto", "cuda:0", "ucx", 1_000)
    assert not keep_in_device_memory("auto", "cuda:0", "ucx", 1_001)  # no room for the copy and its headroom
    # The process's own peak counts: cached blocks a step needs again are not room, idle ones are.
    memory = GpuMemory(free=600, reserved=2_000, peak_allocated=1_500)
    assert room_for_copy(memory) == 1_100 and keep_in_device_memory("auto", "cuda:0", "ucx", 1_000)
    memory = GpuMemory(free=1_100, reserved=500, peak_allocated=2_000)  # the peak needs 1,500 more than is held
    assert room_for_copy(memory) == -400 and not keep_in_device_memory("auto", "cuda:0", "ucx", 10)
    # A free buffer of the role's own pool takes the copy without new memory: no room needed.
    pool = HostBufferPool(pin=False)
    with pool.reserve(1_000):
        assert not keep_in_device_memory("auto", "cuda:0", "ucx", 1_000, pool)  # busy: not reusable
    assert keep_in_device_memory("auto", "cuda:0", "ucx", 1_000, pool)
    assert not keep_in_device_memory("auto", "cuda:0", "ucx", 4_000_000, pool)  # too small for this version
    monkeypatch.setattr(device_memory, "_ucx_carries_cuda_memory", lambda: False)
    assert not keep_in_device_memory("auto", "cuda:0", "ucx", 10)
    assert carries_cuda_memory({"cuda_support": True, "cuda_transports": ["cuda_ipc"]})
    assert not carries_cuda_memory({"cuda_support": True, "cuda_transports": []})
    assert not carries_cuda_memory({"cuda_support": False, "cuda_transports": ["cuda_copy"]})


def test_a_publish_first_settles_the_callers_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from rlctl.weights.device_bundle import settle_producer_stream

    # The copies run on the server's threads, whose current stream is the default one: a state
    # its producer wrote on a stream of its own is waited for in the producer's thread first.
    settled: list[object] = []

    class Stream:
        def synchronize(self) -> None:
            settled.append(self)

    class CudaTensor:  # what the decision reads of a CUDA tensor, on a machine without one
        device = torch.device("cuda", 1)

        def is_contiguous(self) -> bool:
            return True

    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: asked.append(device) or Stream())
    settle_producer_stream({"w": torch.zeros(2)})  # host tensors: nothing to wait for
    settle_producer_stream({})
    assert not settled
    settle_producer_stream({"w": CudaTensor()})
    assert len(settled) == 1 and asked == [torch.device("cuda", 1)]
