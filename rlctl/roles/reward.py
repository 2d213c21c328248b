"""The reward role: verifier workers that score completions (torch-free, stateless).

A reward worker that dies loses nothing: the samples it held go back to the scheduler.

It decodes each response with the job's model folder's tokenizer and scores it with the job's
reward function (``[reward]``; verl's signature; ``auto`` picks the scorer by each sample's data
source, the reference task's included) in a sandbox process with a per-sample time limit: a
function that raises, hangs or kills its process gives the sample a score per ``on_error`` and an
``error`` the controller journals, never a hung or dead worker. A multi-turn episode's score adds
its environment's step rewards (``[env] reward = "sum"``) or is those alone (``"env"``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlctl import worker
from rlctl.roles.common import RoleSettings, model_path, serve_work

CAPACITY = 64
SUBMIT_EVERY_S = 0.1

ScoreItem = Callable[[dict[str, Any]], dict[str, Any]]


def function_scorer(settings: RoleSettings, folder: Path) -> tuple[ScoreItem, Callable[[], None]]:
    """Score with the job's reward function in a sandbox; returns the scorer and its closer."""
    from rlctl.workload.hf_tokenizer import ChatTokenizer
    from rlctl.workload.rewardfn import RewardSpec, SandboxedScorer, ScoreRequest

    tokenizer = ChatTokenizer(folder)
    spec = RewardSpec.from_table(settings.get("reward", {}))
    sandbox = SandboxedScorer(spec)
    env_only = settings.get("env", {}).get("reward") == "env"

    def score_item(item: dict[str, Any]) -> dict[str, Any]:
        episode = item.get("env")
        if episode is not None and env_only:  # a multi-turn episode scored by its environment's step rewards alone
            reward = float(episode["reward"])
            return {"item_id": item["item_id"], "reward": reward, "correct": reward >= 1.0}
        meta = item["meta"]
        text = tokenizer.decode(item["response_tokens"], skip_special_tokens=True)
        outcome = sandbox.score(ScoreRequest(str(meta.get("data_source", "")), text, meta.get("ground_truth"),
                                             dict(meta.get("extra_info") or {}), bool(item.get("truncated"))))
        env_reward = float(episode["reward"]) if episode is not None else 0.0
        result: dict[str, Any] = {"item_id": item["item_id"], "reward": outcome.score + env_reward,
                                  "correct": outcome.correct}
        if outcome.extras:
            result["metrics"] = outcome.extras
        if outcome.error is not None:
            result["error"] = outcome.error
            result["function"] = spec.label
        return result

    return score_item, sandbox.close


def score_and_submit(w: worker.Worker, items: list[dict[str, Any]], score_item: ScoreItem, scored: int = 0) -> int:
    """Score ``items`` and send the scores as they come (every ``SUBMIT_EVERY_S``), not batch by
    batch: a slow verifier does not hold back the groups it has already finished. Returns the
    running count of samples scored (the worker's progress)."""
    scores: list[dict[str, Any]] = []
    sent_at = time.monotonic()
    for item in items:
        scores.append(score_item(item))
        scored += 1
        w.progress(scored)
        if time.monotonic() - sent_at >= SUBMIT_EVERY_S:
            w.request("reward.submit", scores=scores)
            scores, sent_at = [], time.monotonic()
    if scores:
        w.request("reward.submit", scores=scores)
    return scored


def main(w: worker.Worker | None = None) -> int:
    w = w or worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    score_item, close = function_scorer(settings, model_path(settings))
    try:
        return serve_work(w, "reward.get_work", "items", "scoring", CAPACITY,
                          lambda items, scored: score_and_submit(w, items, score_item, scored))
    finally:
        close()


if __name__ == "__main__":
    sys.exit(main())
