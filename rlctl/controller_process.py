"""Entry point of a job's controller process: ``python -m rlctl.controller_process --job-dir DIR [--resume [--expect-epoch N]]``.

It sits above the controller package: it assembles the job (``rlctl.assembly``: the backend and the
workload the spec names) and hands them to the ``Controller``, which never imports the workload.

`rlctl launch` starts it detached; `rlctl resume` starts it again after a crash, with the controller
epoch it read, so that of two resumes at once only one takes the job (the other exits with
``EXIT_FENCED``, writing nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from rlctl.assembly import make_backend, make_workload
from rlctl.controller.jobdir import JobDir
from rlctl.controller.server import Controller, setup_logging
from rlctl.spec_loader import load_job_dir_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.controller_process")
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--expect-epoch", type=int, default=None,
                        help="with --resume: leave the job alone if a controller newer than this epoch started")
    parser.add_argument("--reject-checkpoints", type=json.loads, default={},
                        help="with --resume: {step: why} of checkpoints no restore may use (rlctl resume "
                             "--from-checkpoint)")
    args = parser.parse_args(argv)
    jobdir = JobDir(args.job_dir.resolve())
    setup_logging(jobdir.log_file)
    spec = load_job_dir_spec(jobdir)
    backend = make_backend(spec, jobdir)
    controller = Controller(jobdir, spec, backend, make_workload(spec), resume=args.resume,
                            expect_epoch=args.expect_epoch,
                            rejected_checkpoints={int(step): str(why) for step, why in args.reject_checkpoints.items()})
    return asyncio.run(controller.run())


if __name__ == "__main__":
    sys.exit(main())
