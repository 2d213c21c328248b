"""Entry point of a job's controller process: ``python -m rlctl.controller --job-dir DIR [--resume [--expect-epoch N]]``.

`rlctl launch` starts it detached; `rlctl resume` starts it again after a crash, with the controller
epoch it read, so that of two resumes at once only one takes the job (the other exits with
``EXIT_FENCED``, writing nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rlctl.controller.jobdir import JobDir
from rlctl.controller.server import Controller, setup_logging
from rlctl.jobfile import make_backend, make_workload
from rlctl.specfile import load_job_dir_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.controller")
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--expect-epoch", type=int, default=None,
                        help="with --resume: leave the job alone if a controller newer than this epoch started")
    args = parser.parse_args(argv)
    jobdir = JobDir(args.job_dir.resolve())
    setup_logging(jobdir.log_file)
    spec = load_job_dir_spec(jobdir)
    backend = make_backend(spec, jobdir)
    controller = Controller(jobdir, spec, backend, make_workload(spec), resume=args.resume,
                            expect_epoch=args.expect_epoch)
    return asyncio.run(controller.run())


if __name__ == "__main__":
    sys.exit(main())
