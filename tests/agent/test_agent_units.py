"""Unit tests of the agent's pieces: NCCL log parser, GPU providers, config checks, worker SDK env."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rlctl_agent import protocol
from rlctl_agent.config import ConfigError, load_config, parse_config
from rlctl_agent.gpu import NoGpuError, NvmlProvider, SimProvider, WorkerLoad, make_gpu_provider
from rlctl_agent.nccl import NCCL_FLIGHT_RECORDER, NCCL_TIMEOUT, WorkerLogWatcher, parse_line
from rlctl_agent.supervisor import last_error, signal_error

from rlctl import worker

# Real lines from PyTorch job logs (torch 2.4-2.6 era and older), as ProcessGroupNCCL.cpp prints them.
WATCHDOG_2024 = (
    "[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) "
    "ran for 600081 milliseconds before timing out."
)
WATCHDOG_OLD = (
    "[rank1]:[E ProcessGroupNCCL.cpp:574] [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7, OpType=_ALLGATHER_BASE, NumelIn=1024, NumelOut=16384, Timeout(ms)=600000) "
    "ran for 600029 milliseconds before timing out."
)
TIMEOUT_AT_WORK = (
    "[rank1]:[E1003 18:37:01.833621509 ProcessGroupNCCL.cpp:1709] [PG 0 (default_pg) Rank 1] Timeout at NCCL "
    "work: 6463, last enqueued NCCL work: 6463, last completed NCCL work: 6462."
)
WHAT_LINE = (
    "  what():  [PG 0 (default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6463, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=1800000) ran for 1800017 milliseconds before timing out."
)
HEARTBEAT = (
    "[rank25]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 25] Heartbeat monitor timed out! Process will be terminated "
    "after dumping debug info. workMetaList_.size()=2"
)
DUMP_START = (
    "[rank2]:[E919 06:52:14.737942593 ProcessGroupNCCL.cpp:1628] [PG ID 0 PG GUID 0(default_pg) Rank 2] "
    "ProcessGroupNCCL preparing to dump debug info. Include stack trace: 1, only active collectives: 0"
)
UNRELATED = [
    ("[rank1]:[E1003 18:37:01.833637681 ProcessGroupNCCL.cpp:621] [Rank 1] Some NCCL operations have failed or "
     "timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
     "corrupted/incomplete data."),
    "x3203c0s25b1n0:322638:323016 [0] NCCL INFO comm 0x55df01b24dd0 rank 24 nranks 32 - Init COMPLETE",
    "step 12 loss 0.31",
]


def test_parses_watchdog_timeout_fields() -> None:
    event = parse_line(WATCHDOG_2024)
    assert event is not None and event.kind == NCCL_TIMEOUT
    assert (event.rank, event.seq, event.op_type, event.timeout_ms, event.ran_ms) == (0, 1, "BROADCAST", 600000, 600081)
    assert (event.numel_in, event.numel_out) == (131072000, 131072000)
    old = parse_line(WATCHDOG_OLD)
    assert old is not None and (old.rank, old.seq, old.op_type) == (1, 7, "_ALLGATHER_BASE")


def test_parses_timeout_at_work_heartbeat_and_flight_recorder() -> None:
    at_work = parse_line(TIMEOUT_AT_WORK)
    assert at_work is not None and (at_work.kind, at_work.rank, at_work.pg, at_work.seq) == (NCCL_TIMEOUT, 1, 0, 6463)
    assert at_work.detail()["last_completed"] == 6462
    heartbeat = parse_line(HEARTBEAT)
    assert heartbeat is not None and (heartbeat.kind, heartbeat.trigger, heartbeat.rank) == (
        NCCL_TIMEOUT, "heartbeat-monitor", 25)
    dump = parse_line(DUMP_START)
    assert dump is not None and (dump.kind, dump.rank, dump.pg) == (NCCL_FLIGHT_RECORDER, 2, 0)
    assert all(parse_line(line) is None for line in UNRELATED)


def test_log_watcher_reports_each_timeout_once(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(f"starting\n{TIMEOUT_AT_WORK}\n{WHAT_LINE}\n")
    watcher = WorkerLogWatcher("w7", log)
    assert [(s["kind"], s["worker"], s["detail"]["seq"]) for s in watcher.poll()] == [(NCCL_TIMEOUT, "w7", 6463)]
    with log.open("a") as handle:
        handle.write(WATCHDOG_OLD + "\n")
    assert [s["detail"]["seq"] for s in watcher.poll()] == [7]
    with log.open("a") as handle:
        handle.write(WATCHDOG_OLD + "\n" + HEARTBEAT)
    assert watcher.poll() == []  # a repeat, and a line not finished yet


# torch 2.11 on an H200 (docs/gpu.md, the first GPU run's nccl_watchdog part): the lines as logged.
TORCH_211_RANK0 = [
    "gpucheck-nccl stall-start 1795706277.149 rank=0 mode=stream-stalled",
    ("[rank0]:[E1126 15:18:02.564161906 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=5000) ran for 5069 "
     "milliseconds before timing out."),
    ("[rank0]:[E1126 15:18:02.564377524 ProcessGroupNCCL.cpp:2303] [PG ID 0 PG GUID 0(default_pg) Rank 0]  failure "
     "detected by watchdog at work sequence id: 2 PG status: last enqueued work: 2, last completed work: 1"),
    ("[rank0]:[E1126 15:18:05.158678209 ProcessGroupNCCL.cpp:1628] [PG ID 0 PG GUID 0(default_pg) Rank 0] "
     "ProcessGroupNCCL preparing to dump debug info. Include stack trace: 1, only active collectives: 0"),
]
DUMP_WRITTEN = ("[rank0]:[I1126 15:18:05.301 FlightRecorder.cpp:131] Finished writing Flight Recorder debug info to "
                "/tmp/w/nccl_trace_rank_0")


def test_torch_2_11_lines_arm_the_kill_and_a_written_dump_makes_it_due_at_once(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("\n".join(TORCH_211_RANK0) + "\n")
    watcher = WorkerLogWatcher("w", log)
    assert not watcher.kill_due(100.0, 1.0)
    signals = watcher.poll(now=100.0)
    assert [(s["kind"], s["detail"]["trigger"]) for s in signals] == [(NCCL_TIMEOUT, "watchdog-timeout"),
                                                                      (NCCL_FLIGHT_RECORDER, "dump")]
    assert watcher.fired is not None and watcher.fired.seen_at == 100.0 and "SeqNum=2" in watcher.fired.line
    assert not watcher.kill_due(100.9, 1.0) and watcher.kill_due(101.0, 1.0)
    with log.open("a") as handle:
        handle.write(DUMP_WRITTEN + "\n")
    assert watcher.poll(now=100.2) == []  # the dump's end is the same failure's flight-recorder signal
    assert watcher.kill_due(100.2, 1.0)
    written = parse_line(DUMP_WRITTEN)
    assert written is not None and written.kind == NCCL_FLIGHT_RECORDER
    assert written.detail()["target"] == "/tmp/w/nccl_trace_rank_0"


def test_a_dump_before_any_timeout_never_arms_the_kill(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(DUMP_START + "\n" + DUMP_WRITTEN + "\n")
    watcher = WorkerLogWatcher("w", log)
    assert {s["kind"] for s in watcher.poll(now=0.0)} == {NCCL_FLIGHT_RECORDER}
    assert watcher.fired is None and not watcher.kill_due(1e9, 0.0)


def test_sdk_watchdog_text_is_what_the_agent_parses(tmp_path: Path) -> None:
    text = worker.torch_watchdog_timeout_text(rank=5, seq=99, op_type="REDUCE_SCATTER", numel=64, timeout_ms=30000)
    log = tmp_path / "w.log"
    log.write_text(text)
    signals = WorkerLogWatcher("w", log).poll()
    assert [s["kind"] for s in signals] == [NCCL_TIMEOUT, NCCL_FLIGHT_RECORDER]
    detail = signals[0]["detail"]
    assert (detail["rank"], detail["seq"], detail["op_type"], detail["timeout_ms"]) == (5, 99, "REDUCE_SCATTER", 30000)
    assert detail["ran_ms"] > 30000


def _nvml_driver_present() -> bool:
    try:
        NvmlProvider.open().close()
        return True
    except NoGpuError:
        return False


@pytest.mark.skipif(_nvml_driver_present(), reason="an NVIDIA driver is present; this tests the no-GPU path")
def test_nvml_without_driver_falls_back_to_no_gpu() -> None:
    with pytest.raises(NoGpuError, match="no GPU"):
        NvmlProvider.open()
    for kind in ("auto", "nvml"):
        provider = make_gpu_provider(kind, "n1", 0, list)
        facts = provider.facts()
        assert (provider.name, facts["gpu_provider"], facts["gpus"]) == ("none", "none", [])
        assert "no GPU" in facts["gpu_status"]
        assert provider.sample() == [] and provider.poll_events(10) == []
        provider.close()


def test_sim_gpus_follow_worker_phases_and_faults() -> None:
    loads = [WorkerLoad(gpu=0, phase="training", running=True), WorkerLoad(gpu=1, phase="waiting-for-batch",
                                                                          running=True)]
    sim = SimProvider("n1", 2, lambda: loads)
    busy, idle = sim.sample()
    assert busy["util"] > 80 and idle["util"] < 10
    assert busy["mem_used"] > idle["mem_used"] > 0 and busy["power_w"] > idle["power_w"]
    loads[0] = WorkerLoad(gpu=0, phase="training", running=False)
    assert sim.sample()[0]["util"] == 0
    sim.raise_ecc(0, "sbe")
    sim.raise_xid(1, 79)
    kinds = [(s["kind"], s["gpu"], s["code"]) for s in sim.poll_events(0)]
    assert kinds == [("ecc-sbe", 0, None), ("xid", 1, 79), ("gpu-lost", 1, 79)]
    gpu0, gpu1 = sim.sample()
    assert gpu0["ecc_sbe"] == 1 and gpu1["lost"] is True and gpu1["util"] is None
    with pytest.raises(ValueError, match="lost"):
        sim.raise_ecc(1, "dbe")


def test_config_must_be_private_and_complete(tmp_path: Path) -> None:
    body = {"job_id": "j", "node": "n", "controller_host": "127.0.0.1", "controller_port": 5000,
            "secret_hex": "ab" * 16, "workdir": str(tmp_path)}
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(body))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="0640"):
        load_config(path)
    path.chmod(0o600)
    config = load_config(path)
    assert config.secret == bytes.fromhex("ab" * 16) and "abab" not in repr(config)
    with pytest.raises(ConfigError, match="secret_hex"):
        parse_config({**body, "secret_hex": "zz"})
    with pytest.raises(ConfigError, match="gpu_provider"):
        parse_config({**body, "gpu_provider": "cuda"})
    assert config.nccl_kill_after_s == 1.0 and parse_config({**body, "nccl_kill_after_s": 0}).nccl_kill_after_s == 0
    with pytest.raises(ConfigError, match="nccl_kill_after_s"):
        parse_config({**body, "nccl_kill_after_s": -1})


def test_worker_sdk_outside_an_agent_raises_not_managed() -> None:
    with pytest.raises(worker.WorkerNotManaged):
        worker.connect(env={})


class FakeNvml:
    """Stands in for the pynvml module (real error classes and constants) to drive NvmlProvider without a GPU."""

    def __init__(self) -> None:
        import pynvml

        self._real = pynvml
        self.remap: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.reasons = 0
        self.lost = False
        self.events: list[SimpleNamespace] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)  # NVMLError_*, NVML_* constants, nvmlEventType* bits

    def _check(self) -> None:
        if self.lost:
            raise self._real.NVMLError(self._real.NVML_ERROR_GPU_IS_LOST)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:
        return 0xFFFF

    def nvmlDeviceRegisterEvents(self, handle: object, types: int, event_set: object) -> None:
        assert types & self._real.nvmlEventTypeXidCriticalError

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> SimpleNamespace:
        self._check()
        return SimpleNamespace(gpu=77)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> SimpleNamespace:
        self._check()
        return SimpleNamespace(used=5, total=10)

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        return 312_500

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        return 61

    def nvmlDeviceGetTotalEccErrors(self, handle: object, error_type: int, counter: int) -> int:
        assert counter == self._real.NVML_VOLATILE_ECC
        return 2 if error_type == self._real.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: object) -> int:
        return self.reasons

    def nvmlDeviceGetRemappedRows(self, handle: object) -> tuple[int, int, int, int]:
        return self.remap

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise self._real.NVMLError(self._real.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlDeviceGetIndex(self, device: object) -> int:
        return 0


def test_nvml_provider_samples_edges_events_and_gpu_lost() -> None:
    fake = FakeNvml()
    provider = NvmlProvider(fake, ["handle0"], [{"index": 0, "name": "H100", "uuid": "GPU-x", "memory_total": 10}])
    sample = provider.sample()[0]
    assert (sample["util"], sample["mem_used"], sample["power_w"], sample["ecc_sbe"], sample["lost"]) == (
        77, 5, 312.5, 2, False)
    assert provider.poll_events(0) == []  # a wait timeout is not an error
    fake.remap, fake.reasons = (0, 1, 1, 0), 0x40
    provider.sample()
    provider.sample()
    assert [(s["kind"], s["code"]) for s in provider.poll_events(0)] == [("remap-pending", None), ("throttle", 0x40)]
    fake.events.append(SimpleNamespace(device="d0", eventType=fake.nvmlEventTypeXidCriticalError, eventData=79))
    assert [(s["kind"], s["gpu"], s["code"]) for s in provider.poll_events(0)] == [("xid", 0, 79), ("gpu-lost", 0, 79)]
    fake.lost = True
    assert provider.sample()[0]["lost"] is True
    assert provider.poll_events(0) == []  # already reported lost once


def test_a_workers_last_error_is_its_tracebacks_final_line_and_a_sigbus_names_the_file_it_mapped(tmp_path: Path) -> None:
    log = tmp_path / "rollout-0.3.log"
    log.write_text("loading\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "safetensors_rust.SafetensorError: Error while deserializing header: header too large\n")
    assert last_error(log) == "safetensors_rust.SafetensorError: Error while deserializing header: header too large"
    assert last_error(log, since=log.stat().st_size) == ""
    # Killed by SIGKILL mid-work: what it logged, if anything.
    assert signal_error(9, "") == "" and signal_error(9, "RuntimeError: x") == "RuntimeError: x"
    # A model file rewritten in place under a worker that maps it: the bus error says which kind of
    # cause, and keeps the interpreter's own last words after it.
    log.write_text("Fatal Python error: Bus error\n")
    said = signal_error(7, last_error(log))
    assert said.startswith("SIGBUS: a file it had mapped") and said.endswith("(Fatal Python error: Bus error)"), said
    assert signal_error(7, "").startswith("SIGBUS: a file it had mapped")


def test_json_lines_cut_a_stream_into_objects_and_mark_unreadable_lines() -> None:
    lines = protocol.JsonLines()
    assert lines.feed(b'{"type": "fo') == [] and lines.pending_bytes == 12
    assert lines.feed(b'rk"}\nnot json\n[1, 2]\n' + b"[" * 100 + b"]" * 100 + b'\n{"a": 1}\n{"b"') == [
        {"type": "fork"}, None, None, None, {"a": 1}]
    assert lines.pending_bytes == 4


def test_a_worker_table_that_cannot_be_written_keeps_the_previous_one_and_the_agent_going(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from rlctl_agent.supervisor import Supervisor

    config = parse_config({"job_id": "j", "node": "n", "controller_host": "127.0.0.1", "controller_port": 5000,
                           "secret_hex": "ab" * 16, "workdir": str(tmp_path)})
    supervisor = Supervisor(config)
    assert supervisor.save_state() and json.loads(config.state_path.read_text())["workers"] == []
    blocker = config.state_path.with_suffix(".tmp")
    blocker.mkdir()  # where the new table is written first: the write fails as on a full disk
    assert not supervisor.save_state() and not supervisor.save_state()
    assert json.loads(config.state_path.read_text())["node"] == "n"
    assert sum("could not write the worker table" in r.message for r in caplog.records) == 1
    blocker.rmdir()
    assert supervisor.save_state()


def test_a_workers_stdio_drops_what_a_full_log_cannot_take() -> None:
    import contextlib
    import io
    import sys

    full = open("/dev/full", "w", buffering=1)  # noqa: SIM115 - every write to it fails with ENOSPC
    saved = sys.stdout, sys.stderr
    try:
        with pytest.raises(OSError):
            print("x", file=full, flush=True)
        sys.stdout, sys.stderr = full, io.StringIO()
        worker.keep_going_when_the_log_is_full()
        print("what the trainer says while its disk is full", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        assert sys.stdout.dropped_writes >= 1  # type: ignore[attr-defined]
        assert sys.stderr.getvalue() == "to stderr\n" and sys.stdout.fileno() == full.fileno()
        wrapped = sys.stdout
        worker.keep_going_when_the_log_is_full()
        assert sys.stdout is wrapped
    finally:
        sys.stdout, sys.stderr = saved
        with contextlib.suppress(OSError):
            full.close()
