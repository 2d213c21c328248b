"""Run the GPU-check parts and assemble the one JSON report.

Each part is a function ``() -> dict`` of figures that raises ``Skip(reason)`` when its
requirement is missing; any other exception marks the part failed (with the error text), so one
broken part never hides the others.
"""

from __future__ import annotations

import importlib
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip

REPORT_FORMAT = 1


def run_part(name: str, part: Callable[[], Figures]) -> dict[str, Any]:
    """``{status, seconds, ...figures}``, ``{status: skipped, reason}`` or ``{status: failed, error}``
    (with the figures of a ``CheckFailed`` that carries them)."""
    started = time.perf_counter()
    try:
        figures = part()
        result: dict[str, Any] = {"status": "ok", **figures}
    except Skip as skip:
        result = {"status": "skipped", "reason": str(skip)}
    except Exception as exc:  # noqa: BLE001 - a failed part must not stop the others
        measured = exc.figures if isinstance(exc, CheckFailed) else {}
        result = {**measured, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc(limit=4)[-2000:]}
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


# Each part, in the order it runs: the module (in rlctl.gpucheck, imported only when the check runs) and its function.
PARTS = {
    "nvml": "nvml_part:check_provider",
    "nvml_sample_cost": "nvml_part:sample_cost",
    "torch_rollout": "torch_parts:rollout",
    "torch_decode": "decode_part:decode",
    "torch_train_step": "torch_parts:train_step",
    "ucx_cuda": "ucx_part:cuda_transfer",
    "ucx_cuda_shards": "ucx_part:cuda_shards",
    "weights_stage": "weights_part:stage",
    "weights_pull_local": "weights_part:pull_local",
    "nccl_watchdog": "nccl_part:stalled_collective",
    "local_job": "local_job_part:local_job",
    "nccl_data_parallel": "dp_part:data_parallel",
    "nccl_fsdp": "dp_part:fsdp",
    "vllm_engine": "vllm_part:engine",
    "vllm_resize": "vllm_part:resize",
}
PART_NAMES = tuple(PARTS)


def _part(name: str) -> Callable[[], Figures]:
    module, function = PARTS[name].split(":")
    return getattr(importlib.import_module(f"rlctl.gpucheck.{module}"), function)  # type: ignore[no-any-return]


def _driver_version() -> str | None:
    """The NVIDIA driver's version from NVML, or None where there is no driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no driver: the report says None
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _library_versions() -> dict[str, str | None]:
    """The versions the figures depend on (None: not installed): the model library, UCX and its
    binding, and the checksum a weight bundle carries (sha256 where xxhash is missing: slower)."""
    from importlib.metadata import PackageNotFoundError, version

    from rlctl.weights.checksum import default_checksum_algorithm

    found: dict[str, str | None] = {}
    for package in ("transformers", "nvidia-ml-py", "xxhash"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    try:
        import ucxx

        found["ucxx"] = str(ucxx.__version__)
        found["libucx"] = ".".join(str(part) for part in ucxx.get_ucx_version())
    except Exception:  # noqa: BLE001 - no ucxx (or no libucx under it): the UCX parts skip and say why
        found["ucxx"] = found["libucx"] = None
    found["checksum"] = default_checksum_algorithm()
    return found


def environment() -> dict[str, Any]:
    """What this machine has: python, torch and CUDA versions, the driver, GPU names, and the
    library versions the figures depend on (never raises)."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                            "driver": _driver_version(), **_library_versions()}
    try:
        import torch
    except ImportError as exc:
        return {**info, "torch": None, "cuda_available": False, "reason": f"torch not importable ({exc})"}
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def assemble(environment_found: dict[str, Any], results: dict[str, dict[str, Any]],
             pending: list[str]) -> dict[str, Any]:
    """The report of the parts run so far; ``pending`` names those not run yet (empty at the end)."""
    counts = {status: sum(1 for r in results.values() if r["status"] == status)
              for status in ("ok", "skipped", "failed")}
    report = {"gpucheck": REPORT_FORMAT, "environment": environment_found, "parts": results,
              "summary": counts, "ok": counts["failed"] == 0 and not pending}
    if pending:
        report["pending"] = pending
    return report


def run_all(only: list[str] | None = None,
            after_part: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the selected parts (all by default) in order; return the report. ``after_part`` gets the
    report so far after every part (with ``pending`` naming the parts still to run), so a check cut
    short by a time limit still leaves what it measured."""
    selected = only or list(PART_NAMES)
    unknown = sorted(set(selected) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; known: {list(PART_NAMES)}")
    environment_found = environment()
    results: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(selected):
        print(f"gpucheck: {name} ({index + 1}/{len(selected)})", file=sys.stderr, flush=True)
        results[name] = run_part(name, _part(name))
        print(f"gpucheck: {name} {results[name]['status']} in {results[name]['seconds']} s",
              file=sys.stderr, flush=True)
        if after_part is not None:
            after_part(assemble(environment_found, results, selected[index + 1:]))
    return assemble(environment_found, results, [])
