"""A small role program for the agent tests: reports phases and progress through rlctl.worker.

Options: ``--request`` makes one ``test.echo`` RPC (each attempt waiting ``--request-timeout`` s)
and reports the reply with ``test.got``;
``--exit-after S`` ends it after S seconds with exit status ``--code``; ``--watchdog-after S``
writes, after S seconds, the message torch's NCCL watchdog writes on a collective timeout (with the
unix time it was written, ``watchdog-line-at T``) and then hangs ignoring SIGTERM, as a rank stuck
in a CUDA call does; otherwise it runs until killed, counting progress every 5 ms.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from rlctl import worker


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--request", action="store_true")
    parser.add_argument("--request-timeout", type=float, default=2.0)
    parser.add_argument("--exit-after", type=float)
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument("--watchdog-after", type=float)
    args = parser.parse_args()
    sdk = worker.connect()
    sdk.phase("loading")
    if args.request:
        reply = sdk.request("test.echo", value=41, timeout=args.request_timeout, max_wait=10.0)
        sdk.notify("test.got", reply=reply)
    sdk.phase("generating", step=1)
    started, count = time.monotonic(), 0
    while args.exit_after is None or time.monotonic() - started < args.exit_after:
        if args.watchdog_after is not None and time.monotonic() - started >= args.watchdog_after:
            hang_after_watchdog_line()
        count += 1
        sdk.progress(count)
        time.sleep(0.005)
    sdk.phase("idle", step=1)
    return args.code


def hang_after_watchdog_line() -> None:
    """Write torch's watchdog timeout message (without the abort that follows it) and hang."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    text = worker.torch_watchdog_timeout_text(rank=0, seq=2, timeout_ms=5000, flight_recorder=False)
    first_line = text.splitlines()[0]
    sys.stderr.write(f"watchdog-line-at {time.time():.3f}\n{first_line}\n")
    sys.stderr.flush()
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
