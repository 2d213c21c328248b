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
from pathlib import Path
from typing import Any

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


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Replace ``path`` with ``report`` at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, default=str) + "\n")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.gpucheck", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=PART_NAMES, help="run only these parts")
    parser.add_argument("--report", type=Path, metavar="FILE",
                        help="also write the report to FILE, rewritten after every part (with 'pending' "
                             "naming the parts not run yet), so a run cut short keeps what it measured")
    args = parser.parse_args(argv)
    after_part = (lambda report: write_report(args.report, report)) if args.report else None
    with stdout_to_stderr():
        report = run_all(args.only, after_part)
    print(json.dumps(report, sort_keys=False, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
