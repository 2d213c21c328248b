"""Tail-batching scheduler invariants under random schedules (hypothesis) and replay equality."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.core.events import Event
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig


def make_scheduler(tail: bool, batch: int = 4, group: int = 2, prompts: int = 20, long_batch: int = 4) -> RoundScheduler:
    config = SchedulerConfig(
        batch_prompts=batch,
        group_size=group,
        max_new_tokens=64,
        tail_enabled=tail,
        short_max_tokens=8,
        overprovision=0.5,
        long_batch=long_batch,
        seed=3,
    )
    refs = [PromptRef(f"p{i:03d}", (1, 2, 3), {"length": i}) for i in range(prompts)]
    return RoundScheduler(config, refs)


def lengths_for(prompt_id: str, rng: random.Random) -> int:
    """Some prompts are long-tail: their responses exceed the short cap."""
    return rng.randint(20, 60) if int(prompt_id[1:]) % 5 == 0 else rng.randint(1, 8)


def drive(scheduler: RoundScheduler, steps: int, rng: random.Random, fail_rate: float,
          reward: Callable[[str, int], float] = lambda prompt_id, index: 1.0) -> list[Event]:
    """Run ``steps`` rounds with two rollouts and one reward worker, failing workers at random;
    ``reward(prompt_id, sample_index)`` scores each sample."""
    log: list[Event] = []
    now = 0.0
    rollout_gen = {"r0": 0, "r1": 0}
    for step in range(steps):
        log += scheduler.start_round(step, now)
        for _ in range(10_000):
            now += 0.01
            rnd = scheduler.round
            assert rnd is not None
            if rnd.closed:
                break
            for slot in ("r0", "r1"):
                wid = f"{slot}.{rollout_gen[slot]}"
                log += scheduler.dispatch(slot, wid, rng.randint(1, 5), now)
                held = [s for s in rnd.samples.values() if s.wid == wid and s.status == "inflight"]
                if held and rng.random() < fail_rate:
                    log += scheduler.release_worker(wid, "crash", now)
                    rollout_gen[slot] += 1
                    continue
                results = []
                for sample in held[: rng.randint(0, len(held))]:
                    n = lengths_for(sample.prompt_id, rng)
                    cap = rnd.max_new_tokens
                    results.append(
                        {
                            "item_id": sample.item_id,
                            "response_tokens": [7] * min(n, cap),
                            "truncated": n > cap,
                            "weights_version": rnd.weights_version,
                        }
                    )
                log += scheduler.submit(slot, wid, results, now)
                if scheduler.round is not rnd:
                    break
            if rnd.closed or scheduler.round is not rnd:
                continue
            log += scheduler.dispatch_scoring("w0", "w0.0", rng.randint(1, 6), now)
            scored = [s for s in rnd.samples.values() if s.wid == "w0.0" and s.status == "scoring"]
            log += scheduler.submit_scores(
                "w0.0", [{"item_id": s.item_id, "reward": reward(s.prompt_id, s.sample_index), "correct": True}
                         for s in scored], now
            )
        assert scheduler.batch_for(step) is not None, f"step {step} never formed a batch"
    return log


def check_invariants(scheduler: RoundScheduler, all_ids: set[str]) -> None:
    per_epoch: dict[int, list[str]] = {}
    for step, batch in scheduler.batches.items():
        assert batch.weights_version == step
        for sample in batch.samples:
            assert sample.weights_version == step, "off-policy sample trained"
            assert sample.reward is not None
        assert len(batch.samples) == len(batch.prompt_ids) * scheduler.config.group_size
        per_epoch.setdefault(batch.epoch, []).extend(batch.prompt_ids)
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)), f"a prompt was trained twice in epoch {epoch}"
    pool, queue, trained = set(scheduler.pool), set(scheduler.long_queue), scheduler.epoch_trained
    filtered = scheduler.epoch_filtered
    rnd = scheduler.round
    in_round = set(rnd.prompt_ids) - set(rnd.deferred) if rnd is not None and not rnd.closed else set()
    assert len(scheduler.pool) == len(pool)
    parts = [pool, queue, trained, filtered, in_round]
    assert sum(len(p) for p in parts) == len(set().union(*parts)), "a prompt is in two places"
    assert set().union(*parts) == all_ids, "a prompt was lost"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), tail=st.booleans(), fail_rate=st.sampled_from([0.0, 0.05, 0.2]))
def test_invariants_hold_under_random_schedules(seed: int, tail: bool, fail_rate: float) -> None:
    scheduler = make_scheduler(tail)
    drive(scheduler, steps=8, rng=random.Random(seed), fail_rate=fail_rate)
    check_invariants(scheduler, set(scheduler.prompts))


def test_replaying_the_events_rebuilds_the_same_state() -> None:
    live = make_scheduler(True)
    log = drive(live, steps=6, rng=random.Random(1), fail_rate=0.1)
    replayed = make_scheduler(True)
    for ev in log:
        replayed.apply(ev)
    assert list(replayed.pool) == list(live.pool)
    assert replayed.long_queue == live.long_queue
    assert replayed.epoch_trained == live.epoch_trained
    assert {s: b.prompt_ids for s, b in replayed.batches.items()} == {s: b.prompt_ids for s, b in live.batches.items()}


def test_short_rounds_cap_length_and_defer_long_prompts_to_a_long_round() -> None:
    scheduler = make_scheduler(True)
    drive(scheduler, steps=10, rng=random.Random(7), fail_rate=0.0)
    kinds = [b.kind for b in scheduler.batches.values()]
    assert "long" in kinds and "short" in kinds
    for batch in scheduler.batches.values():
        longest = max(len(s.response_tokens or []) for s in batch.samples)
        if batch.kind == "short":
            assert longest <= scheduler.config.short_max_tokens


def test_plain_synchronous_batching_never_defers() -> None:
    scheduler = make_scheduler(False)
    drive(scheduler, steps=5, rng=random.Random(2), fail_rate=0.0)
    assert {b.kind for b in scheduler.batches.values()} == {"sync"}
    assert not scheduler.long_queue


def test_rollback_returns_prompts_so_none_is_lost() -> None:
    scheduler = make_scheduler(True)
    drive(scheduler, steps=4, rng=random.Random(5), fail_rate=0.0)
    scheduler.rollback(2, 100.0)
    assert set(scheduler.batches) == {0, 1}
    check_invariants(scheduler, set(scheduler.prompts))


def test_start_long_round_settles_a_part_full_long_queue() -> None:
    scheduler = make_scheduler(tail=True, long_batch=4)
    assert scheduler.start_long_round(0, 1.0) == []  # nothing deferred, nothing to open
    scheduler.long_queue = ["p000", "p001"]  # as if two prompts had been deferred by short rounds
    events = scheduler.start_long_round(0, 1.0)
    rnd = scheduler.round
    assert [e.type for e in events] == ["RoundStarted"]
    assert rnd is not None and rnd.kind == "long" and rnd.prompt_ids == ["p000", "p001"]
    assert rnd.target_groups == 2 and rnd.max_new_tokens == 64 and scheduler.long_queue == []


def test_the_cursor_of_a_checkpoint_leaves_out_batches_formed_for_later_steps() -> None:
    scheduler = make_scheduler(tail=False, batch=4, group=1, prompts=20)
    trained: dict[int, list[str]] = {}
    for step in range(3):
        scheduler.start_round(step, float(step))
        rnd = scheduler.round
        assert rnd is not None
        scheduler.dispatch("r0", "w", 100, 0.0)
        scheduler.submit("r0", "w", [{"item_id": i, "response_tokens": [1], "truncated": False, "weights_version": step}
                                     for i in rnd.samples], 0.0)
        scheduler.dispatch_scoring("rw", "s", 100, 0.0)
        scheduler.submit_scores("s", [{"item_id": i, "reward": 1.0, "correct": True} for i in rnd.samples], 0.0)
        trained[step] = list(rnd.prompt_ids)
    cursor = scheduler.cursor_at(2)
    assert cursor["step"] == 2 and cursor["epoch"] == 0 and cursor["prompts_total"] == 20
    assert cursor["trained_this_epoch"] == sorted(trained[0] + trained[1])
    assert len(scheduler.cursor_at(3)["trained_this_epoch"]) == 12
