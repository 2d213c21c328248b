"""DAPO's dynamic sampling and overlong shaping in the round scheduler: a group whose metric does not
vary is dropped, the round draws more prompts until its batch holds that many groups that vary (with
tail batching's over-provisioning and long rounds), within ``max_num_gen_batches``, and a replay of
the journal rebuilds the same state; held-out evaluation takes ``val_kwargs.n`` samples a prompt."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.core.algorithm import FilterGroupsSpec, OverlongBufferSpec
from rlctl.core.event_payloads import EpochStartedData
from rlctl.core.events import Event
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig
from tests.core.test_rounds import check_invariants, drive, make_scheduler


def config(tail: bool = False, batch: int = 4, group: int = 3, metric: str = "acc", max_gen: int = 0,
           overprovision: float = 0.5) -> SchedulerConfig:
    return SchedulerConfig(batch_prompts=batch, group_size=group, max_new_tokens=64, tail_enabled=tail,
                           short_max_tokens=8, overprovision=overprovision, long_batch=batch, seed=5,
                           filter_groups=FilterGroupsSpec(True, metric, max_gen))


def prompts(count: int) -> list[PromptRef]:
    return [PromptRef(f"p{i:03d}", (1, 2), {}) for i in range(count)]


def in_file_order(scheduler: RoundScheduler) -> RoundScheduler:
    """The first epoch takes the prompts in their order (not shuffled), so each test knows its draws."""
    scheduler.apply(Event.of(0.0, EpochStartedData(epoch=0, order=sorted(scheduler.prompts))))
    return scheduler


def constant(prompt_id: str) -> bool:
    """Every third prompt is one the policy always gets right: its group never varies."""
    return int(prompt_id[1:]) % 3 == 0


def score_of(prompt_id: str, index: int) -> float:
    return 1.0 if constant(prompt_id) or index == 0 else 0.0


def run_round(scheduler: RoundScheduler, step: int, long_ids: set[str] = frozenset(), now: float = 0.0) -> list[Event]:
    """Open, generate and score round ``step`` to its end (one rollout, one reward worker)."""
    log = scheduler.start_round(step, now)
    for _ in range(1000):
        rnd = scheduler.round
        assert rnd is not None
        if rnd.closed or scheduler.unfillable() is not None:
            break
        now += 0.01
        log += scheduler.dispatch("r0", "r0.0", 4, now)
        held = [s for s in rnd.samples.values() if s.wid == "r0.0" and s.status == "inflight"]
        log += scheduler.submit("r0", "r0.0", [
            {"item_id": s.item_id, "response_tokens": [7] * (40 if s.prompt_id in long_ids else 5),
             "truncated": s.prompt_id in long_ids and rnd.max_new_tokens < 40, "weights_version": rnd.weights_version}
            for s in held], now)
        if rnd.closed or scheduler.round is not rnd:
            continue
        log += scheduler.dispatch_scoring("w0", "w0.0", 5, now)
        scored = [s for s in rnd.samples.values() if s.wid == "w0.0" and s.status == "scoring"]
        log += scheduler.submit_scores("w0.0", [
            {"item_id": s.item_id, "reward": score_of(s.prompt_id, s.sample_index), "correct": False} for s in scored], now)
    return log


def test_a_group_whose_metric_does_not_vary_is_dropped_and_the_round_draws_until_the_batch_holds_varying_groups() -> None:
    scheduler = in_file_order(RoundScheduler(config(), prompts(40)))
    log = run_round(scheduler, 0)
    batch = scheduler.batch_for(0)
    assert batch is not None and len(batch.prompt_ids) == 4
    assert not any(constant(p) for p in batch.prompt_ids), "a group that does not vary was trained"
    formed = next(e for e in log if e.type == "BatchFormed").data
    assert formed["filtered_prompt_ids"] and all(constant(p) for p in formed["filtered_prompt_ids"])
    extended = [e.data for e in log if e.type == "RoundExtended"]
    assert extended, "the round never drew more prompts"
    drawn = [p for e in extended for p in e["prompts"]]
    assert len(set(drawn)) == len(drawn) and not set(drawn) & set(scheduler.prompts) - set(scheduler.round.prompt_ids)
    # The filtered prompts are spent for the epoch: neither back in the pool nor trained.
    assert not set(formed["filtered_prompt_ids"]) & set(scheduler.pool)


def test_without_dynamic_sampling_the_same_round_trains_the_groups_that_do_not_vary() -> None:
    scheduler = in_file_order(RoundScheduler(replace(config(), filter_groups=FilterGroupsSpec()), prompts(40)))
    log = run_round(scheduler, 0)
    batch = scheduler.batch_for(0)
    assert batch is not None and batch.prompt_ids == ["p000", "p001", "p002", "p003"]
    assert not [e for e in log if e.type == "RoundExtended"]


def test_max_num_gen_batches_bounds_the_draws_and_the_job_is_told_why() -> None:
    scheduler = in_file_order(RoundScheduler(config(max_gen=1), prompts(40)))
    run_round(scheduler, 0)
    reason = scheduler.unfillable()
    assert reason is not None and reason.startswith("failed: algorithm.filter_groups")
    assert "max_num_gen_batches" in reason and scheduler.batch_for(0) is None
    two = in_file_order(RoundScheduler(config(max_gen=2), prompts(40)))
    run_round(two, 0)
    assert two.unfillable() is None and two.batch_for(0) is not None
    assert len(two.round.prompt_ids) <= 2 * 4


def test_a_data_set_with_too_few_varying_prompts_fails_instead_of_drawing_forever() -> None:
    scheduler = RoundScheduler(config(), [PromptRef(f"p{i:03d}", (1,), {}) for i in (0, 1, 3, 6, 9, 12)])
    run_round(scheduler, 0)
    reason = scheduler.unfillable()
    assert reason is not None and "every prompt of the data set" in reason


def test_a_missing_metric_fails_the_job_naming_it() -> None:
    scheduler = in_file_order(RoundScheduler(config(metric="pass_rate"), prompts(40)))
    run_round(scheduler, 0)
    reason = scheduler.unfillable()
    assert reason is not None and "'pass_rate'" in reason


@pytest.mark.parametrize("metric", ["acc", "score", "reward", "seq_reward"])
def test_the_metrics_read_verl_s_values(metric: str) -> None:
    scheduler = in_file_order(RoundScheduler(config(metric=metric), prompts(40)))
    run_round(scheduler, 0)
    assert scheduler.batch_for(0) is not None and not any(constant(p) for p in scheduler.batch_for(0).prompt_ids)


def test_with_tail_batching_refills_are_over_provisioned_and_long_prompts_still_go_to_long_rounds() -> None:
    long_ids = {"p004", "p010"}
    scheduler = in_file_order(RoundScheduler(config(tail=True), prompts(60)))
    log = run_round(scheduler, 0, long_ids)
    batch = scheduler.batch_for(0)
    assert batch is not None and batch.kind == "short" and len(batch.prompt_ids) == 4
    assert not set(batch.prompt_ids) & long_ids
    deferred = {e.data["prompt_id"] for e in log if e.type == "PromptDeferred"}
    assert deferred <= long_ids and deferred
    for ev in (e for e in log if e.type == "RoundExtended"):
        assert len(ev.data["prompts"]) >= 1


def test_a_long_round_that_filters_draws_from_the_long_queue_first() -> None:
    scheduler = RoundScheduler(config(tail=True, batch=2), prompts(60))
    scheduler.long_queue = ["p003", "p006", "p004", "p007"]  # p003 and p006 never vary
    log = run_round(scheduler, 0)
    assert [e.data["kind"] for e in log if e.type == "RoundStarted"] == ["long"]
    batch = scheduler.batch_for(0)
    assert batch is not None and batch.kind == "long" and set(batch.prompt_ids) == {"p004", "p007"}


def test_a_round_that_draws_past_the_epoch_s_end_starts_the_next_epoch_without_repeating_its_prompts() -> None:
    scheduler = in_file_order(RoundScheduler(config(batch=3), prompts(8)))
    log = run_round(scheduler, 0)
    assert not [e for e in log if e.type == "EpochStarted"]
    log += run_round(scheduler, 1)
    epochs = [e.data for e in log if e.type == "EpochStarted"]
    assert [e["epoch"] for e in epochs] == [1]
    assert scheduler.batch_for(1) is not None and len(scheduler.batch_for(1).prompt_ids) == 3
    in_round = {p for e in log if e.type in ("RoundStarted", "RoundExtended") and e.data["step"] == 1
                for p in e.data["prompts"]}
    assert len(in_round) == len([p for e in log if e.type in ("RoundStarted", "RoundExtended")
                                 and e.data["step"] == 1 for p in e.data["prompts"]])


def test_replaying_the_journal_rebuilds_the_accepted_pending_and_filtered_groups() -> None:
    live = RoundScheduler(config(tail=True), prompts(60))
    log = run_round(live, 0, {"p004"})
    log += live.start_round(1, 1.0)
    log += live.dispatch("r0", "r0.0", 7, 1.1)
    rnd = live.round
    held = [s for s in rnd.samples.values() if s.status == "inflight"]
    log += live.submit("r0", "r0.0", [{"item_id": s.item_id, "response_tokens": [5, 6], "truncated": False,
                                       "weights_version": 1} for s in held], 1.2)
    log += live.dispatch_scoring("w0", "w0.0", 9, 1.3)
    scored = [s for s in rnd.samples.values() if s.status == "scoring"]
    log += live.submit_scores("w0.0", [{"item_id": s.item_id, "reward": score_of(s.prompt_id, s.sample_index),
                                        "correct": False} for s in scored], 1.4)
    replayed = RoundScheduler(config(tail=True), prompts(60))
    for ev in log:
        replayed.apply(ev)
    for attr in ("completed", "filtered", "deferred", "prompt_ids"):
        assert getattr(replayed.round, attr) == getattr(live.round, attr), attr
    assert {k: s.status for k, s in replayed.round.samples.items()} == {k: s.status for k, s in live.round.samples.items()}
    assert list(replayed.pool) == list(live.pool) and replayed.long_queue == live.long_queue
    assert replayed.batch_for(0).prompt_ids == live.batch_for(0).prompt_ids


def test_overlong_shaping_is_measured_against_the_job_s_cap_in_every_kind_of_round() -> None:
    base = replace(config(tail=True), filter_groups=FilterGroupsSpec(),
                   overlong_buffer=OverlongBufferSpec(True, 16, 0.5))
    scheduler = RoundScheduler(base, prompts(20))
    scheduler.start_round(0, 0.0)
    rnd = scheduler.round
    assert rnd.kind == "short" and rnd.max_new_tokens == 8
    scheduler.dispatch("r0", "r0.0", 100, 0.1)
    lengths = {}
    results = []
    for i, sample in enumerate(s for s in rnd.samples.values() if s.status == "inflight"):
        lengths[sample.item_id] = 3 + i % 6
        results.append({"item_id": sample.item_id, "response_tokens": [9] * lengths[sample.item_id], "truncated": False,
                        "weights_version": 0})
    scheduler.submit("r0", "r0.0", results, 0.2)
    scheduler.dispatch_scoring("w0", "w0.0", 100, 0.3)
    scoring = [s for s in rnd.samples.values() if s.status == "scoring"]
    events = scheduler.submit_scores("w0.0", [{"item_id": s.item_id, "reward": 1.0, "correct": True} for s in scoring], 0.4)
    stored = {entry["item_id"]: entry for e in events if e.type == "RewardsStored" for entry in e.data["scores"]}
    # The buffer starts at 64 - 16 = 48 tokens: a short round's responses (at most 8) are never penalised.
    assert stored and all(entry["reward"] == 1.0 and entry["overlong_reward"] == 0.0 for entry in stored.values())
    assert OverlongBufferSpec(True, 16, 0.5).penalty(56, 64) == pytest.approx(-0.25)
    assert OverlongBufferSpec(True, 16, 0.5).penalty(64, 64) == pytest.approx(-0.5)
    assert OverlongBufferSpec(True, 16, 0.5).penalty(48, 64) == 0.0


def test_a_long_response_is_shaped_and_the_unshaped_score_is_kept() -> None:
    base = replace(config(), filter_groups=FilterGroupsSpec(), overlong_buffer=OverlongBufferSpec(True, 16, 1.0))
    scheduler = RoundScheduler(base, prompts(20))
    scheduler.start_round(0, 0.0)
    rnd = scheduler.round
    scheduler.dispatch("r0", "r0.0", 100, 0.1)
    held = [s for s in rnd.samples.values() if s.status == "inflight"]
    scheduler.submit("r0", "r0.0", [{"item_id": s.item_id, "response_tokens": [9] * 60, "truncated": False,
                                     "weights_version": 0} for s in held], 0.2)
    scheduler.dispatch_scoring("w0", "w0.0", 100, 0.3)
    events = scheduler.submit_scores("w0.0", [{"item_id": s.item_id, "reward": 1.0, "correct": True}
                                              for s in rnd.samples.values() if s.status == "scoring"], 0.4)
    entry = next(x for e in events if e.type == "RewardsStored" for x in e.data["scores"])
    assert entry["score"] == 1.0 and entry["overlong_reward"] == pytest.approx(-0.75)
    assert entry["reward"] == pytest.approx(0.25)
    batch = scheduler.batch_for(0)
    assert batch is not None and all(s.reward == pytest.approx(0.25) and s.score == 1.0 for s in batch.samples)


def test_held_out_takes_n_samples_a_prompt_and_scores_each_prompt_by_their_mean() -> None:
    held = [PromptRef(f"e{i}", (1,), {}) for i in range(3)]
    scheduler = RoundScheduler(replace(config(), held_out_every=1, held_out_samples=4), prompts(20), held)
    started = scheduler.start_held_out(0, 0.0)
    assert started[0].data["samples_per_prompt"] == 4 and len(scheduler.held_out.samples) == 12
    seeds = {s.seed for s in scheduler.held_out.samples.values()}
    assert len(seeds) == 12
    scheduler.dispatch("r0", "r0.0", 100, 0.1)
    scheduler.submit("r0", "r0.0", [{"item_id": i, "response_tokens": [1], "truncated": False, "weights_version": 0}
                                    for i in scheduler.held_out.samples], 0.2)
    scheduler.dispatch_scoring("w0", "w0.0", 100, 0.3)
    rng = random.Random(0)
    rewards = {i: float(rng.random() < 0.5) for i in scheduler.held_out.samples}
    events = scheduler.submit_scores("w0.0", [{"item_id": i, "reward": r, "correct": r > 0} for i, r in rewards.items()],
                                     0.4)
    scored = next(e.data for e in events if e.type == "HeldOutScored")
    per_prompt = [sum(r for i, r in rewards.items() if i.startswith(f"h0/e{p}/")) / 4 for p in range(3)]
    assert scored["prompts"] == 3 and scored["reward_mean"] == pytest.approx(sum(per_prompt) / 3, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tail=st.booleans(), fail_rate=st.sampled_from([0.0, 0.1]))
def test_no_prompt_is_lost_or_trained_twice_with_dynamic_sampling(seed: int, tail: bool, fail_rate: float) -> None:
    scheduler = RoundScheduler(replace(make_scheduler(tail).config, filter_groups=FilterGroupsSpec(True, "acc", 0)),
                               list(make_scheduler(tail).prompts.values()))
    drive(scheduler, steps=8, rng=random.Random(seed), fail_rate=fail_rate,
          reward=lambda prompt_id, index: score_of(prompt_id, index))
    check_invariants(scheduler, set(scheduler.prompts))
    for batch in scheduler.batches.values():
        assert not any(constant(p) for p in batch.prompt_ids)
