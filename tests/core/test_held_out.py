"""Held-out evaluation in the round scheduler: due versions, dispatch after the round's own
samples, scoring into ``HeldOutScored``, worker failures, no training effect, replay."""

from __future__ import annotations

from rlctl.core.events import Event
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig


def make_scheduler(every: int = 2, held_out: int = 3) -> RoundScheduler:
    config = SchedulerConfig(batch_prompts=2, group_size=2, max_new_tokens=32, tail_enabled=False,
                             short_max_tokens=8, overprovision=0.0, long_batch=2, seed=5, held_out_every=every)
    train = [PromptRef(f"d{i}", (1, 2), {}) for i in range(6)]
    evals = [PromptRef(f"e{i}", (1, 3), {"ground_truth": str(i)}) for i in range(held_out)]
    return RoundScheduler(config, train, evals)


def test_due_every_n_versions_and_the_final_one_each_once() -> None:
    scheduler = make_scheduler(every=3)
    assert [v for v in range(8) if scheduler.held_out_due(v, final=False)] == [0, 3, 6]
    assert scheduler.held_out_due(7, final=True)
    scheduler.start_held_out(3, 0.0)
    assert not scheduler.held_out_due(6, final=False)  # one evaluation at a time
    assert not make_scheduler(every=0).held_out_due(0, final=True)
    plain = RoundScheduler(make_scheduler().config, [PromptRef("d0", (1,), {})])
    assert not plain.held_out_due(0, final=True)  # no held-out prompts


def generate_all(scheduler: RoundScheduler, wid: str, log: list[Event], version: int, length: int = 4) -> None:
    held = [s for s in list(scheduler.round.samples.values()) + list(scheduler.held_out.samples.values())  # type: ignore[union-attr]
            if s.wid == wid and s.status == "inflight"]
    log += scheduler.submit("r0", wid, [{"item_id": s.item_id, "response_tokens": [7] * length, "truncated": False,
                                         "weights_version": version} for s in held], 1.0)


def test_round_samples_go_first_then_held_out_ones_and_the_result_is_recorded() -> None:
    scheduler = make_scheduler()
    log: list[Event] = []
    log += scheduler.start_round(0, 0.0)
    log += scheduler.start_held_out(0, 0.0)
    held_out_ids = set(scheduler.held_out.samples)  # type: ignore[union-attr]
    assert all(i.startswith("h0/e") for i in held_out_ids) and len(held_out_ids) == 3

    first = scheduler.dispatch("r0", "w1", 100, 0.1)
    log += first
    assert set(first[0].data["item_ids"]).isdisjoint(held_out_ids)  # the round's samples first
    second = scheduler.dispatch("r0", "w1", 100, 0.2)
    log += second
    assert set(second[0].data["item_ids"]) == held_out_ids  # then, while the round's are in flight, held-out ones
    assert scheduler.cancelled_among(sorted(held_out_ids)) == []
    assert scheduler.work_held_by("w1", "inflight")[0] == "round"
    generate_all(scheduler, "w1", log, 0)
    assert scheduler.trajectories_stored == 4  # held-out samples are not trajectories

    log += scheduler.dispatch_scoring("rw", "s1", 100, 0.3)
    scores = [{"item_id": i, "reward": 1.0 if i.endswith(("e0", "e1")) or i.startswith("s") else 0.0, "correct": True}
              for i in list(scheduler.round.samples) + sorted(held_out_ids)]  # type: ignore[union-attr]
    log += scheduler.submit_scores("s1", scores, 0.4)
    kinds = [e.type for e in log]
    assert "BatchFormed" in kinds and kinds[-1] == "HeldOutScored"
    result = log[-1].data
    assert result["version"] == 0 and result["prompts"] == 3 and abs(result["reward_mean"] - 2 / 3) < 1e-6
    assert result["reward_std_err"] > 0 and result["accuracy"] == 1.0
    assert scheduler.held_out is None and scheduler.held_out_results == [{k: result[k] for k in (
        "version", "prompts", "reward_mean", "reward_std_err", "accuracy")}]
    batch = scheduler.batch_for(0)
    assert batch is not None and all(not s.item_id.startswith("h") for s in batch.samples)

    replayed = make_scheduler()
    for ev in log:
        replayed.apply(ev)
    assert replayed.held_out_results == scheduler.held_out_results and replayed.held_out is None


def test_held_out_seeds_are_the_same_at_every_evaluation() -> None:
    scheduler = make_scheduler()
    scheduler.start_held_out(0, 0.0)
    seeds_v0 = {s.prompt_id: s.seed for s in scheduler.held_out.samples.values()}  # type: ignore[union-attr]
    later = make_scheduler()
    later.start_held_out(4, 0.0)
    assert {s.prompt_id: s.seed for s in later.held_out.samples.values()} == seeds_v0  # type: ignore[union-attr]


def test_a_failed_worker_gives_its_held_out_samples_back_and_stale_weights_are_refused() -> None:
    scheduler = make_scheduler()
    scheduler.start_held_out(2, 0.0)
    scheduler.dispatch("r0", "w1", 2, 0.1)
    assert len(scheduler.work_held_by("w1", "inflight")[1]) == 2
    returned = scheduler.release_worker("w1", "crash", 0.2)
    assert returned and len(returned[0].data["item_ids"]) == 2
    assert all(s.status == "pending" for s in scheduler.held_out.samples.values())  # type: ignore[union-attr]
    dispatched = scheduler.dispatch("r1", "w2", 5, 0.3)[0].data["item_ids"]
    stale = scheduler.submit("r1", "w2", [{"item_id": dispatched[0], "response_tokens": [1], "truncated": False,
                                          "weights_version": 1}], 0.4)
    assert [e.type for e in stale] == ["ItemsReturned"] and stale[0].data["reason"] == "stale-weights"


def test_rollback_drops_a_running_evaluation() -> None:
    scheduler = make_scheduler()
    scheduler.start_round(0, 0.0)
    scheduler.start_held_out(0, 0.0)
    scheduler.rollback(0, 0.1)
    assert scheduler.held_out is None
    assert scheduler.held_out_due(0, final=False)
