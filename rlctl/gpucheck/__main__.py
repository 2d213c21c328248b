"""``python -m rlctl.gpucheck [--only PART ...]``: run the GPU check, print one JSON object.

Exit status 0 when no part failed (skipped parts are fine: a machine without a GPU passes by
skipping), 1 when a part failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

from rlctl.gpucheck.report import PART_NAMES, run_all


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send fd 1 to fd 2 meanwhile (engines and NCCL log to stdout), so the JSON is alone on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.gpucheck", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=PART_NAMES, help="run only these parts")
    args = parser.parse_args(argv)
    with stdout_to_stderr():
        report = run_all(args.only)
    print(json.dumps(report, sort_keys=False, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
