"""Process bodies for the weight-transfer tests (run under multiprocessing spawn).

Each function sets the UCX environment first (ucxx reads it when it initialises, and a process
has one UCX context), then acts as a holder or a joiner and reports through a queue. The
holder's failure modes patch the real transport code *inside the holder process only*, so the
joiner talks to a genuinely dying or corrupted peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

UCX_TLS_FOR = {"tcp": "tcp,self", "ucx": "tcp,self", "ucx-sm": "sm,self"}


def set_env(transport: str) -> None:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS=UCX_TLS_FOR[transport], UCXPY_PROGRESS_MODE="blocking",
                      UCX_WARN_UNUSED_ENV_VARS="n")


def make_state(seed: int, big_elements: int = 1 << 16) -> dict[str, Any]:
    """Deterministic real tensors: float32, bf16, int64, bool, several shapes, an empty and a 0-d one."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 16, generator=gen),
        "layer.0.attn.qkv": torch.randn(3, 16, 16, generator=gen).to(torch.bfloat16),
        "layer.0.norm.bias": torch.randn(16, generator=gen).to(torch.bfloat16),
        "positions": torch.randint(-(2**40), 2**40, (5, 7), generator=gen, dtype=torch.int64),
        "mask": torch.rand(9, generator=gen) > 0.5,
        "empty": torch.empty(0, 16),
        "scale": torch.tensor(0.125),
        "strided": torch.randn(8, 6, generator=gen).t(),
        "big": torch.randn(big_elements, generator=gen),
    }


# ---------------------------------------------------------------------------------------------
# holder

LATE_SEND_S = 0.5


def _send_late() -> None:
    """Patch a ucx-sm holder so it sends only once the joiner has given up (closed the control
    connection), ``LATE_SEND_S`` later: as a holder stopped between its reply and its send, and
    resumed, would. The joiner's receive is posted, unmatched, all along."""
    from rlctl.weights import transport_ucx

    async def late(send: Any, ack: Any) -> None:
        with contextlib.suppress(Exception):
            await ack  # fails when the joiner closes the control connection
        await asyncio.sleep(LATE_SEND_S)
        await send

    transport_ucx._first_failure_or_all = late


def _die_mid_transfer(transport: str) -> None:
    """Patch the holder so it exits (like a SIGKILL: no cleanup) in the middle of a transfer."""
    if transport == "tcp":
        from rlctl.weights import framing

        real_send_all = framing.send_all

        async def send_half_then_die(sock: Any, view: memoryview, deadline: float) -> None:
            if len(view) > 1 << 20:
                await real_send_all(sock, view[: len(view) // 2], deadline)
                os._exit(1)
            await real_send_all(sock, view, deadline)

        framing.send_all = send_half_then_die
        return
    from rlctl.weights import transport_ucx

    real_bounded = transport_ucx._bounded

    async def die_before_body(awaitable: Any, deadline: float, what: str) -> Any:
        if "sending the weights" in what:
            os._exit(1)
        return await real_bounded(awaitable, deadline, what)

    transport_ucx._bounded = die_before_body


def holder_main(transport: str, seed: int, version: int, big_elements: int, mode: str,
                out: mp.Queue, stop: Any, shared_memory: bool = False) -> None:
    """Serve `make_state(seed)` as `version` until `stop` (a pipe end) is readable; put the descriptor on `out`.

    mode: "normal"; "corrupt" flips one byte of the served buffer after publishing (its
    checksum stays the published one); "die" exits mid-transfer; "late-send" (ucx-sm) sends only
    after the joiner gave up. `shared_memory`: joiners on this
    node are handed the version's memory file (`transport_shm`).
    """
    set_env(transport)
    from rlctl.weights import WeightServerThread, fetch_sync

    if mode == "die":
        _die_mid_transfer(transport)
    if mode == "late-send":
        _send_late()
    with WeightServerThread(transport=transport, shared_memory=shared_memory) as server:
        descriptor = server.publish(version, make_state(seed, big_elements))
        if mode == "corrupt":
            bundle = server.server.current_bundle()
            assert bundle is not None
            bundle.buffer[bundle.manifest.nbytes // 2] ^= 0x01
        if mode == "normal":  # one process serving and fetching at once (one ucxx worker)
            version, state = fetch_sync(descriptor, timeout=20.0)
            expected = make_state(seed, big_elements)
            descriptor["self_fetch_ok"] = version == descriptor["version"] and all(
                state[name].dtype == tensor.dtype and bool((state[name] == tensor).all()) for name, tensor in expected.items())
        out.put(descriptor)
        stop.poll(60)


# ---------------------------------------------------------------------------------------------
# joiner


def _describe(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)}


async def _fetch_and_compare(source: dict[str, Any], seed: int, big_elements: int, timeout: float) -> dict[str, Any]:
    import torch

    from rlctl.weights import fetch

    started = time.monotonic()
    try:
        version, state = await fetch(source, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on the class
        return {**_describe(exc), "elapsed": time.monotonic() - started}
    expected = make_state(seed, big_elements)
    mismatched = [name for name, tensor in expected.items()
                  if name not in state or state[name].dtype != tensor.dtype or not torch.equal(state[name], tensor)]
    return {"ok": not mismatched and set(state) == set(expected), "version": version,
            "mismatched": mismatched, "elapsed": time.monotonic() - started}


Scenario = tuple[str, dict[str, Any], int, int, float]  # name, source, seed, big_elements, timeout


def joiner_main(transport: str, scenarios: list[Scenario], out: mp.Queue) -> None:
    """Run every scenario's fetch concurrently (one asyncio task each); put `{name: result}` on `out`."""
    set_env(transport)

    async def run_all() -> dict[str, dict[str, Any]]:
        results = await asyncio.gather(*(_fetch_and_compare(source, seed, big, timeout)
                                         for _, source, seed, big, timeout in scenarios))
        return {name: result for (name, *_), result in zip(scenarios, results, strict=True)}

    out.put(asyncio.run(run_all()))


def idle_cpu_after_fetch_main(transport: str, source: dict[str, Any], fetches: int, idle_s: float, out: mp.Queue) -> None:
    """Fetch ``fetches`` times, then report the CPU seconds this process used while idle for ``idle_s``."""
    import resource

    set_env(transport)
    from rlctl.weights import fetch_sync

    for _ in range(fetches):
        fetch_sync(source, timeout=30)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = usage.ru_utime + usage.ru_stime
    time.sleep(idle_s)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put(usage.ru_utime + usage.ru_stime - before)


# ---------------------------------------------------------------------------------------------
# strangers: a job's holder under a flood, a joiner and a UCX peer that never sends its token


def guarded_holder_main(transport: str, token_hex: str, max_concurrent: int, commands: Any) -> None:
    """A job's holder (made with the job's token) of a 1 MiB state, driven over the pipe ``commands``:
    it sends its descriptor, then its admission counts (as a dict) for each "admission", until "stop"."""
    from dataclasses import asdict

    import numpy as np

    set_env(transport)
    from rlctl.weights.auth import TOKEN_ENV

    os.environ[TOKEN_ENV] = token_hex
    from rlctl.weights import WeightServerThread

    with WeightServerThread(transport=transport, max_concurrent=max_concurrent) as server:
        commands.send(server.publish(1, {"w": np.arange(1 << 18, dtype=np.float32)}))
        while commands.recv() != "stop":
            commands.send(asdict(server.admission()))


def fetch_once_main(transport: str, source: dict[str, Any], token_hex: str, timeout: float, out: mp.Queue) -> None:
    """Fetch ``source`` once with the job's token; put ``{ok, elapsed, error?}`` on ``out``."""
    set_env(transport)
    from rlctl.weights.auth import TOKEN_ENV

    os.environ[TOKEN_ENV] = token_hex
    from rlctl.weights import fetch_sync

    started = time.monotonic()
    try:
        version, _ = fetch_sync(source, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        out.put({**_describe(exc), "elapsed": time.monotonic() - started})
        return
    out.put({"ok": version == source["version"], "elapsed": time.monotonic() - started})


def silent_ucx_endpoint_main(source: dict[str, Any], limit_s: float, out: mp.Queue) -> None:
    """Open a UCX endpoint to the holder's listener, send nothing, and put on ``out`` how many
    seconds passed before the holder closed it (None: still open after ``limit_s``)."""
    set_env("ucx")
    import numpy as np

    from rlctl.weights.transport_ucx import UcxRuntime

    runtime = UcxRuntime.get()

    async def wait_for_close() -> float | None:
        endpoint = await runtime.ucxx.create_endpoint(source["host"], int(source["port"]))
        started = time.monotonic()
        try:
            await asyncio.wait_for(endpoint.recv(np.zeros(1, dtype=np.uint64)), limit_s)
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - any UCX error here means the holder closed the endpoint
            return time.monotonic() - started
        return None

    out.put(runtime.run_sync(runtime.hot(wait_for_close())))


# ---------------------------------------------------------------------------------------------
# lanes: which UCX lanes a pull takes, with UCX_TLS as a test sets it


def lanes_holder_main(transport: str, tls: str, out: mp.Queue, stop: Any) -> None:
    """Serve a 4 MiB state over ``transport`` with ``UCX_TLS=tls``; put the descriptor on ``out``."""
    set_env(transport)
    os.environ["UCX_TLS"] = tls
    import numpy as np

    from rlctl.weights import WeightServerThread

    with WeightServerThread(transport=transport) as server:
        out.put(server.publish(1, {"w": np.arange(1 << 20, dtype=np.float32)}))
        stop.poll(60)


def lanes_joiner_main(tls: str, sources: dict[str, dict[str, Any]], out: mp.Queue) -> None:
    """Fetch each of ``sources`` with ``UCX_TLS=tls``; put ``{name: pull record}`` on ``out``."""
    set_env("ucx")
    os.environ["UCX_TLS"] = tls
    from rlctl.weights import fetch_bundle_sync
    from rlctl.weights.lanes import faster_lane

    records: dict[str, dict[str, Any]] = {}
    for name, source in sources.items():
        try:
            pull = fetch_bundle_sync(source, timeout=30.0).pull
            assert pull is not None
            records[name] = {**pull.to_json(), "faster_lane": faster_lane(pull)}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            records[name] = _describe(exc)
    out.put(records)


# ---------------------------------------------------------------------------------------------
# device copies: a holder that keeps the version in device memory (the CPU twin: device "cpu")


def device_holder_main(transport: str, seed: int, mode: str, out: mp.Queue, stop: Any) -> None:
    """Publish ``make_state(seed)`` as version 3 with a copy in device memory; put the descriptor
    on ``out``. mode "corrupt-device" flips one byte of the device copy after publishing (its
    fingerprint stays the published one); the host bundle stays intact."""
    set_env(transport)
    os.environ["UCX_TLS"] = "sm,tcp,self"
    from rlctl.weights import WeightServerThread

    with WeightServerThread(transport=transport) as server:
        descriptor = server.publish(3, make_state(seed), device_copy=True)
        if mode == "corrupt-device":
            on_device = server.server.current_device_bundle()
            assert on_device is not None
            on_device.flat[on_device.manifest.nbytes // 3] ^= 0x10
        out.put(descriptor)
        stop.poll(60)


def device_joiner_main(sources: dict[str, dict[str, Any]], seed: int, out: mp.Queue) -> None:
    """Pull each of ``sources`` into device memory (device "cpu") with one pool, compare with
    ``make_state(seed)``; put ``{name: record}`` on ``out`` (and "host" for a host pull of the first)."""
    set_env("ucx")
    os.environ["UCX_TLS"] = "sm,tcp,self"
    import torch

    from rlctl.weights import WeightServerThread, fetch_bundle_sync, fetch_device_bundle_sync, unflatten
    from rlctl.weights.device_bundle import DeviceBufferPool

    expected = make_state(seed)
    pool = DeviceBufferPool("cpu")

    def same(state: dict[str, Any]) -> bool:
        return all(state[name].dtype == tensor.dtype and state[name].shape == tensor.shape
                   and bool((state[name] == tensor).all()) for name, tensor in expected.items())

    records: dict[str, dict[str, Any]] = {}
    for name, source in sources.items():
        try:
            bundle = fetch_device_bundle_sync(source, pool, timeout=30.0)
            assert bundle.pull is not None
            records[name] = {"ok": True, "same": same(bundle.tensors()), "device": bundle.device,
                             "views_pool": bundle.flat.data_ptr() in {b.tensor.data_ptr() for b in pool.buffers},
                             **bundle.pull.to_json()}
            del bundle
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            records[name] = _describe(exc)
    records["pool"] = {"allocations": pool.allocations}
    first = next(iter(sources.values()))
    host = fetch_bundle_sync(first, timeout=30.0)
    records["host"] = {"ok": True, "same": same(unflatten(host.manifest, host.buffer)), "torch": torch.__version__}
    # Served on from device memory only (a rollout that pulled there): joiners asking for either memory get it.
    held = fetch_device_bundle_sync(first, pool, timeout=30.0)
    with WeightServerThread(transport="ucx") as server:
        served = server.publish_device_bundle(held)
        again = fetch_bundle_sync(served, timeout=30.0)
        records["served-on"] = {"host_same": same(unflatten(again.manifest, again.buffer)),
                                "checksum": served["checksum"] == first["checksum"],
                                "fingerprint": served["device_fingerprint"] == first["device_fingerprint"],
                                "host_bundle": server.server.current_bundle() is not None}
    out.put(records)


def abandoning_joiner_main(late: dict[str, Any], normal: dict[str, Any], out: mp.Queue) -> None:
    """Pull from the ``late-send`` holder ``late`` twice, giving up once by the deadline and once
    by cancelling; report how each ended and the landing's changed bytes when the pull returned
    and after the holder's late send; then pull ``normal`` whole with the same worker."""
    set_env("ucx-sm")
    import numpy as np

    from rlctl.weights import verify
    from rlctl.weights.staging import writes_in_flight
    from rlctl.weights.transport_ucx import sm_receive

    async def pull(source: dict[str, Any], landing: Any, limit_s: float, cancel_after_s: float | None) -> str:
        deadline = asyncio.get_running_loop().time() + limit_s
        task = asyncio.ensure_future(sm_receive(source, deadline, out=landing))
        if cancel_after_s is not None:
            await asyncio.sleep(cancel_after_s)
            task.cancel()
        try:
            manifest, buffer, _route = await task
        except BaseException as exc:  # noqa: BLE001 - reported: the test asserts on which
            return type(exc).__name__
        verify(manifest, buffer, source["version"], source["checksum"])
        return "received"

    report: dict[str, Any] = {}
    for ends, limit_s, cancel_after_s in (("deadline", 2.0, None), ("cancelled", 30.0, 2.0)):
        landing = np.zeros(int(late["nbytes"]), dtype=np.uint8)
        how = asyncio.run(pull(late, landing, limit_s, cancel_after_s))
        at_return = int(np.count_nonzero(landing))
        time.sleep(LATE_SEND_S + 1.5)
        report[ends] = {"how": how, "at_return": at_return, "later": int(np.count_nonzero(landing))}
    report["still_receiving"] = writes_in_flight()
    report["then"] = asyncio.run(pull(normal, np.zeros(int(normal["nbytes"]), dtype=np.uint8), 30.0, None))
    out.put(report)


def tcp_lane_holder_main(nbytes: int, out: mp.Queue, stop: Any) -> None:
    """A ucx-sm holder whose UCX has only tcp lanes (fragment by fragment, so a transfer can be
    stopped half-way): serve ``nbytes`` of 7s; put its pid and descriptor on ``out``."""
    set_env("ucx")
    import numpy as np

    from rlctl.weights import WeightServerThread

    with WeightServerThread(transport="ucx-sm") as server:
        out.put((os.getpid(), server.publish(1, {"w": np.full(nbytes, 7, dtype=np.uint8)})))
        stop.poll(120)


def stopped_mid_pull_joiner_main(source: dict[str, Any], to_test: mp.Queue, from_test: mp.Queue) -> None:
    """Pull ``source`` three times over tcp lanes, into a fresh buffer, a pooled host buffer and a
    pooled device buffer (the CPU twin's); each time
    say "started" on ``to_test`` when the first bytes land (the test then stops the holder), give
    up at the deadline, report what holds the buffer, wait for "resumed", and report again once
    UCX ended the receive."""
    set_env("ucx")
    import gc
    import threading
    import weakref

    import numpy as np

    from rlctl.weights.staging import HostBufferPool, writes_in_flight
    from rlctl.weights.transport_ucx import sm_receive

    nbytes = int(source["nbytes"])

    def say_when_started(landing: Any) -> None:
        while not landing[:4096].any():
            time.sleep(0.002)
        to_test.put("started")

    async def pull(landing: Any) -> str:
        threading.Thread(target=say_when_started, args=(landing,), daemon=True).start()
        try:
            await sm_receive(source, asyncio.get_running_loop().time() + 3.0, out=landing)
        except BaseException as exc:  # noqa: BLE001 - reported
            return type(exc).__name__
        return "received"

    def wait_for_ucx() -> bool:
        ends = time.monotonic() + 30
        while writes_in_flight() and time.monotonic() < ends:
            time.sleep(0.05)
        gc.collect()
        return writes_in_flight() == 0

    fresh = np.zeros(nbytes, dtype=np.uint8)
    kept = weakref.ref(fresh)
    how = asyncio.run(pull(fresh))
    at_return = int(np.count_nonzero(fresh))
    del fresh
    gc.collect()
    report: dict[str, Any] = {"fresh": {"how": how, "partial": 0 < at_return < nbytes,
                                        "receiving": writes_in_flight(), "kept": kept() is not None}}
    to_test.put("returned")
    assert from_test.get(timeout=60) == "resumed"
    report["fresh"].update(ended=wait_for_ucx(), freed_after=kept() is None)

    pool = HostBufferPool(pin=False, max_buffers=1)
    with pool.reserve(nbytes) as host:
        landing = host.view(nbytes)
        landing[:] = 0
        how = asyncio.run(pull(landing))
        at_return = int(np.count_nonzero(landing))
    del landing
    report["pooled"] = {"how": how, "partial": 0 < at_return < nbytes, "busy": not pool.has_free(nbytes)}
    to_test.put("returned")
    assert from_test.get(timeout=60) == "resumed"
    report["pooled"].update(ended=wait_for_ucx(), free_after=pool.has_free(nbytes))

    from rlctl.weights.device_bundle import DeviceBufferPool

    device_pool = DeviceBufferPool("cpu")  # the CPU twin of a GPU's device buffers
    with device_pool.reserve(nbytes) as device:
        tensor = device.view(nbytes)
        tensor.zero_()
        how = asyncio.run(pull(tensor))
        at_return = int(np.count_nonzero(tensor.numpy()))
    del tensor
    report["device"] = {"how": how, "partial": 0 < at_return < nbytes, "busy": not device_pool.has_free(nbytes)}
    to_test.put("returned")
    assert from_test.get(timeout=60) == "resumed"
    report["device"].update(ended=wait_for_ucx(), free_after=device_pool.has_free(nbytes))
    to_test.put(report)
