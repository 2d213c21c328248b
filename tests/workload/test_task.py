"""Task generation, tokenizer and scoring: determinism, verifiable answers, the long tail."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.workload.task import (
    ALPHABET,
    BOS_ID,
    DIGIT_WORDS,
    EOS_ID,
    TOKENIZER,
    derive_seed,
    length_stats,
    make_dataset,
    percentile,
    score,
)


def test_dataset_is_deterministic_per_seed() -> None:
    first, again, other = make_dataset(300, 7), make_dataset(300, 7), make_dataset(300, 8)
    assert first == again
    assert [p.meta for p in first] != [p.meta for p in other]
    assert len({p.prompt_id for p in first}) == 300


def test_meta_is_json_and_prompt_starts_with_bos() -> None:
    for prompt in make_dataset(200, 1):
        assert json.loads(json.dumps(prompt.meta)) == prompt.meta
        assert prompt.tokens[0] == BOS_ID
        assert TOKENIZER.decode(prompt.tokens) == prompt.meta["question"]
        assert prompt.meta["expected_len"] == len(prompt.meta["answer"]) + 1


def _independent_answer(question: str) -> str:
    body = question.rstrip("=")
    if body.startswith("spell "):
        return " ".join(DIGIT_WORDS[int(d)] for d in body.split()[1])
    if body.startswith("count "):
        _, start, stop = body.split()
        return " ".join(str(i) for i in range(int(start), int(stop) + 1))
    if body.startswith("down "):
        return " ".join(str(i) for i in reversed(range(int(body.split()[1]) + 1)))
    left, right = body.split("+")
    return str(int(left) + int(right))


def test_answers_are_checkable_for_every_family() -> None:
    prompts = make_dataset(1000, 3)
    assert {p.meta["family"] for p in prompts} == {"add", "spell", "count"}
    for prompt in prompts:
        assert prompt.meta["answer"] == _independent_answer(prompt.meta["question"])


def test_down_family_is_checkable_and_off_by_default() -> None:
    prompts = make_dataset(1000, 4, mix={"add": 0.2, "spell": 0.2, "count": 0.3, "down": 0.3})
    assert {p.meta["family"] for p in prompts} == {"add", "spell", "count", "down"}
    for prompt in prompts:
        assert prompt.meta["answer"] == _independent_answer(prompt.meta["question"])
    assert all(p.meta["family"] != "down" for p in make_dataset(2000, 4))


def test_down_family_has_the_same_long_tail_as_count() -> None:
    down = length_stats(make_dataset(20000, 0, mix={"down": 1.0}))
    assert down["p50"] <= 10 and 100 <= down["p99"] <= 160, down


def test_length_alpha_must_be_positive() -> None:
    try:
        make_dataset(10, 0, length_alpha=0.0)
    except ValueError as exc:
        assert "length_alpha" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_expected_lengths_have_a_long_tail() -> None:
    stats = length_stats(make_dataset(20000, 0))
    assert 8 <= stats["p50"] <= 16, stats
    assert 100 <= stats["p99"] <= 200, stats
    assert stats["p99"] >= 8 * stats["p50"], stats


def test_max_expected_len_filter() -> None:
    assert max(p.meta["expected_len"] for p in make_dataset(500, 2, max_expected_len=24)) <= 24


def test_score_correct_incorrect_and_truncated() -> None:
    meta = {"answer": "42"}
    assert score(meta, TOKENIZER.encode("42", add_eos=True)) == (1.0, True)
    assert score(meta, TOKENIZER.encode("42", add_eos=True) + TOKENIZER.encode("junk")) == (1.0, True)
    reward, correct = score(meta, TOKENIZER.encode("42"))  # no EOS: truncated, not correct
    assert not correct and reward == 0.5
    reward, correct = score(meta, TOKENIZER.encode("41", add_eos=True))
    assert not correct and reward == 0.25
    assert score(meta, [EOS_ID]) == (0.0, False)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0


def test_derive_seed_is_stable_and_spread() -> None:
    assert derive_seed(0, 1, "p") == derive_seed(0, 1, "p")
    assert len({derive_seed(0, s, "p", k) for s in range(20) for k in range(20)}) == 400
    assert all(0 <= derive_seed(i) < 2**63 for i in range(50))


@given(st.text(alphabet=ALPHABET, max_size=200))
def test_tokenizer_round_trip(text: str) -> None:
    ids = TOKENIZER.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert TOKENIZER.decode(ids) == text
    assert all(0 <= i < TOKENIZER.vocab_size for i in ids)


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=TOKENIZER.vocab_size - 1), max_size=60),
       st.sampled_from(make_dataset(50, 11)))
def test_reward_is_bounded(tokens: list[int], prompt) -> None:  # type: ignore[no-untyped-def]
    reward, correct = score(prompt.meta, tokens)
    assert 0.0 <= reward <= 1.0
    assert correct == (reward == 1.0)


def test_encode_rejects_unknown_characters() -> None:
    try:
        TOKENIZER.encode("HELLO")
    except ValueError as exc:
        assert "not in the tokenizer alphabet" in str(exc)
    else:
        raise AssertionError("expected ValueError")
