"""Reward scheduling in the round scheduler: generation never waits for a verifier, idle rollout
workers take small chunks of a long scoring backlog (and never below the threshold), every scorer
takes an even share, a helper
that dies gives its samples back, and the groups streamed to the trainer are the batch's prefix."""

from __future__ import annotations

from rlctl.core.round_state import Round
from rlctl.core.rounds import HELPER_CHUNK, RoundScheduler
from tests.core.test_rounds import make_scheduler


def started(**shape: int) -> tuple[RoundScheduler, Round]:
    """A scheduler of ``shape`` (make_scheduler's) with round 0 open."""
    scheduler = make_scheduler(tail=False, **shape)
    scheduler.start_round(0, 0.0)
    assert scheduler.round is not None
    return scheduler, scheduler.round


def generate_all(scheduler: RoundScheduler, now: float) -> None:
    """Two rollouts generate every pending sample of the round (short responses)."""
    rnd = scheduler.round
    assert rnd is not None
    while True:
        handed = False
        for slot in ("r0", "r1"):
            wid = f"{slot}.0"
            scheduler.dispatch(slot, wid, 3, now)
            held = [s for s in rnd.samples.values() if s.wid == wid and s.status == "inflight"]
            handed = handed or bool(held)
            scheduler.submit(slot, wid, [{"item_id": s.item_id, "response_tokens": [7, 7], "truncated": False,
                                          "weights_version": rnd.weights_version} for s in held], now)
        if not handed:
            return


def test_a_verifier_that_never_answers_does_not_stop_generation() -> None:
    scheduler, rnd = started(batch=4, group=2)
    scheduler.dispatch_scoring("w0", "w0.0", 1000, 0.0)  # the reward worker takes all there is, and hangs
    generate_all(scheduler, 1.0)
    assert all(s.status in ("done", "scoring") for s in rnd.samples.values()), "every sample was generated"
    assert scheduler.scoring_backlog() == sum(1 for s in rnd.samples.values() if s.status == "done") > 0


def test_idle_rollouts_take_small_chunks_of_a_long_backlog_only() -> None:
    scheduler, _ = started(batch=8, group=4, prompts=40)
    generate_all(scheduler, 1.0)
    backlog = scheduler.scoring_backlog()
    assert backlog > HELPER_CHUNK
    assert scheduler.dispatch_helper_scoring("r0", "r0.0", 0, 2.0) == [], "0 means never"
    assert scheduler.dispatch_helper_scoring("r0", "r0.0", backlog + 1, 2.0) == [], "below the threshold"
    taken = scheduler.dispatch_helper_scoring("r0", "r0.0", backlog, 2.0)
    assert len(taken) == 1 and len(taken[0].data["item_ids"]) == HELPER_CHUNK
    assert scheduler.scoring_backlog() == backlog - HELPER_CHUNK
    scheduler.release_worker("r0.0", "the helper died", 3.0)
    assert scheduler.scoring_backlog() == backlog, "its samples wait for a score again"


def test_scorers_take_even_shares_so_the_first_to_ask_does_not_take_the_batch() -> None:
    scheduler, _ = started(batch=4, group=4, prompts=40)
    generate_all(scheduler, 1.0)
    backlog = scheduler.scoring_backlog()
    assert backlog == 16
    taken = scheduler.dispatch_scoring("w0", "w0.0", 32, 2.0, scorers=4)  # the reward worker, 3 helpers beside it
    assert len(taken[0].data["item_ids"]) == 4
    helper = scheduler.dispatch_helper_scoring("r0", "r0.0", 2, 2.0, scorers=4)
    assert len(helper[0].data["item_ids"]) == 3, "an even share of the 12 left"
    assert len(scheduler.dispatch_scoring("w1", "w1.0", 32, 2.0)[0].data["item_ids"]) == 9, "alone, all there is"
    assert scheduler.dispatch_scoring("w2", "w2.0", 32, 2.0, scorers=4) == [], "nothing left"


def test_the_streamed_groups_are_the_prefix_of_the_batch() -> None:
    scheduler, rnd = started(batch=4, group=2, prompts=20)
    generate_all(scheduler, 1.0)
    streamed: list[str] = []
    for _ in range(100):
        if rnd.closed:
            break
        scheduler.dispatch_scoring("w0", "w0.0", 3, 2.0)
        scoring = [s for s in rnd.samples.values() if s.wid == "w0.0" and s.status == "scoring"]
        scheduler.submit_scores("w0.0", [{"item_id": s.item_id, "reward": 1.0, "correct": True} for s in scoring], 2.0)
        if not rnd.closed:
            streamed = list(rnd.completed[:rnd.target_groups])  # what trainer.get_stream could have served
    batch = scheduler.batch_for(0)
    assert batch is not None and streamed
    assert batch.prompt_ids[:len(streamed)] == streamed
