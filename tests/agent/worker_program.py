"""A small role program for the agent tests: reports phases and progress through rlctl.worker.

Options: ``--request`` makes one ``test.echo`` RPC (each attempt waiting ``--request-timeout`` s)
and reports the reply with ``test.got``;
``--exit-after S`` ends it after S seconds with exit status ``--code``; otherwise it runs until
killed, counting progress every 5 ms.
"""

from __future__ import annotations

import argparse
import sys
import time

from rlctl import worker


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--request", action="store_true")
    parser.add_argument("--request-timeout", type=float, default=2.0)
    parser.add_argument("--exit-after", type=float)
    parser.add_argument("--code", type=int, default=0)
    args = parser.parse_args()
    sdk = worker.connect()
    sdk.phase("loading")
    if args.request:
        reply = sdk.request("test.echo", value=41, timeout=args.request_timeout, max_wait=10.0)
        sdk.notify("test.got", reply=reply)
    sdk.phase("generating", step=1)
    started, count = time.monotonic(), 0
    while args.exit_after is None or time.monotonic() - started < args.exit_after:
        count += 1
        sdk.progress(count)
        time.sleep(0.005)
    sdk.phase("idle", step=1)
    return args.code


if __name__ == "__main__":
    sys.exit(main())
