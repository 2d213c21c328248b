"""The reward role: verifier workers that score completions (torch-free, concurrent, stateless).

A reward worker that dies loses nothing: the samples it held go back to the scheduler.
"""

from __future__ import annotations

import sys

from rlctl import worker
from rlctl.roles.common import wait_or_stop
from rlctl.workload.task import score

CAPACITY = 64


def main(w: worker.Worker | None = None) -> int:
    w = w or worker.connect()
    scored = 0
    while True:
        w.phase("waiting-for-work")
        reply = w.request("reward.get_work", capacity=CAPACITY)
        if not reply or "items" not in reply:
            if wait_or_stop(reply):
                return 0
            continue
        w.phase("scoring")
        scores = []
        for item in reply["items"]:
            reward, correct = score(item["meta"], item["response_tokens"])
            scores.append({"item_id": item["item_id"], "reward": reward, "correct": correct})
            scored += 1
            w.progress(scored)
        w.request("reward.submit", scores=scores)


if __name__ == "__main__":
    sys.exit(main())
