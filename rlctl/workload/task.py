"""The reference RL task: locally generated, verifiable prompts whose answer lengths have a long tail.

Role: the data side of the reference GRPO workload. The controller imports this module to own
prompts and to score responses, so it is **stdlib only** (no torch, no numpy) and every function
is pure and deterministic for a given seed.

Four task families, each with a checkable answer (the default mix uses the first three):

- ``add``: ``"37+5="`` -> ``"42"``. Short answers (1-3 characters).
- ``spell``: ``"spell 407="`` -> ``"four zero seven"``. Medium answers (4-24 characters).
- ``count``: ``"count 12 19="`` -> ``"12 13 14 15 16 17 18 19"``. The number of terms is drawn from a
  Pareto distribution (shape ``COUNT_PARETO_ALPHA``), so a few answers are much longer than the
  rest. This family makes the long tail that tail batching exploits.
- ``down``: ``"down 7="`` -> ``"7 6 5 4 3 2 1 0"``, the same Pareto number of terms. Not in the
  default mix. Where ``count`` must learn when to stop (compare what it wrote with the prompt's
  last number, which the small CPU model does not learn in a short warm-start: it stops early),
  ``down`` stops at ``0``, so a small model writes its answers at their full length and the
  generated lengths keep the task's long tail (``bench/tail_batching.py --long-family down``).

With the default mix, expected response lengths (answer characters + EOS) have p50 ≈ 10 tokens
and p99 ≈ 130 tokens (checked in ``tests/workload/test_task.py``).

The tokenizer is character level: ids 0/1/2 are pad/bos/eos, then one id per character of
``ALPHABET``. A prompt is ``[bos] + chars``; a response is ``chars + [eos]``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +=-"

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FAMILIES = ("add", "spell", "count", "down")
DEFAULT_MIX: dict[str, float] = {"add": 0.25, "spell": 0.45, "count": 0.30}
COUNT_PARETO_ALPHA = 0.9
COUNT_MAX_TERMS = 50
COUNT_MAX_START = 99
INCORRECT_REWARD_SCALE = 0.5


class Tokenizer:
    """Character-level tokenizer over ``ALPHABET`` with pad/bos/eos specials."""

    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._offset = 3
        self._char_to_id = {ch: i + self._offset for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + self._offset

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Map text to ids; raises ``ValueError`` on a character outside the alphabet."""
        try:
            ids = [self._char_to_id[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer alphabet") from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> str:
        """Map ids back to text, skipping pad/bos; stops at the first EOS unless told otherwise."""
        chars: list[str] = []
        for token in ids:
            if token == self.eos_id and stop_at_eos:
                break
            if token >= self._offset and token < self.vocab_size:
                chars.append(self.alphabet[token - self._offset])
        return "".join(chars)


TOKENIZER = Tokenizer()


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``tokens`` start with BOS; ``meta`` is JSON-serialisable (answer, family, ...)."""

    prompt_id: str
    tokens: list[int] = field(hash=False)
    meta: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class _Problem:
    family: str
    question: str
    answer: str
    difficulty: int


def _make_add(rng: random.Random) -> _Problem:
    digits = rng.choice((1, 1, 2))
    a = rng.randrange(10**digits)
    b = rng.randrange(10 ** rng.choice((1, digits)))
    difficulty = 0 if a + b < 10 else 1
    return _Problem("add", f"{a}+{b}=", str(a + b), difficulty)


def _make_spell(rng: random.Random) -> _Problem:
    digits = rng.randint(2, 4)
    number = str(rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits))
    answer = " ".join(DIGIT_WORDS[int(d)] for d in number)
    return _Problem("spell", f"spell {number}=", answer, digits)


def pareto_terms(rng: random.Random, alpha: float, cap: int) -> int:
    """A heavy-tailed count >= 2: ``1 + floor(U ** (-1/alpha))`` capped at ``cap``."""
    u = 1.0 - rng.random()  # in (0, 1]
    return min(cap, 1 + math.floor(u ** (-1.0 / alpha)))


def _make_count(rng: random.Random, alpha: float) -> _Problem:
    terms = pareto_terms(rng, alpha, COUNT_MAX_TERMS)
    start = rng.randint(0, COUNT_MAX_START)
    stop = start + terms - 1
    answer = " ".join(str(i) for i in range(start, stop + 1))
    difficulty = 2 + min(3, int(math.log2(terms)))
    return _Problem("count", f"count {start} {stop}=", answer, difficulty)


def _make_down(rng: random.Random, alpha: float) -> _Problem:
    terms = pareto_terms(rng, alpha, COUNT_MAX_TERMS)
    answer = " ".join(str(i) for i in range(terms - 1, -1, -1))
    return _Problem("down", f"down {terms - 1}=", answer, 2 + min(3, int(math.log2(terms))))


def _make_problem(family: str, rng: random.Random, length_alpha: float) -> _Problem:
    if family == "add":
        return _make_add(rng)
    if family == "spell":
        return _make_spell(rng)
    if family == "count":
        return _make_count(rng, length_alpha)
    return _make_down(rng, length_alpha)


def _choose_family(rng: random.Random, mix: Mapping[str, float]) -> str:
    names = sorted(mix)
    return rng.choices(names, weights=[mix[n] for n in names], k=1)[0]


def expected_response_len(answer: str) -> int:
    """Tokens in the reference response: one per answer character plus EOS."""
    return len(answer) + 1


def make_prompt(prompt_id: str, problem: _Problem, tokenizer: Tokenizer = TOKENIZER) -> Prompt:
    meta = {
        "family": problem.family,
        "question": problem.question,
        "answer": problem.answer,
        "difficulty": problem.difficulty,
        "expected_len": expected_response_len(problem.answer),
    }
    return Prompt(prompt_id, tokenizer.encode(problem.question, add_bos=True), meta)


def make_dataset(
    n: int,
    seed: int,
    mix: Mapping[str, float] | None = None,
    max_expected_len: int | None = None,
    length_alpha: float | None = None,
) -> list[Prompt]:
    """``n`` prompts, deterministic for ``seed``.

    ``mix`` weights the families (default ``DEFAULT_MIX``); ``max_expected_len`` rejects and redraws
    problems whose reference response is longer (used by quick tests and the learning check);
    ``length_alpha`` is the Pareto shape of the ``count`` and ``down`` term counts (default
    ``COUNT_PARETO_ALPHA``; smaller means more long answers, which a warm-start uses to see
    enough of them). Prompt ids are ``"s{seed}-{index}"``.
    """
    alpha = COUNT_PARETO_ALPHA if length_alpha is None else length_alpha
    if alpha <= 0:
        raise ValueError(f"length_alpha must be > 0, got {alpha}")
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(mix) - set(FAMILIES)
    if unknown or not any(w > 0 for w in mix.values()):
        raise ValueError(f"bad family mix {mix!r}")
    rng = random.Random(f"rlctl-task-{seed}")
    prompts: list[Prompt] = []
    while len(prompts) < n:
        problem = _make_problem(_choose_family(rng, mix), rng, alpha)
        if max_expected_len is not None and expected_response_len(problem.answer) > max_expected_len:
            continue
        prompts.append(make_prompt(f"s{seed}-{len(prompts)}", problem))
    return prompts


def response_text(response_tokens: Sequence[int], tokenizer: Tokenizer = TOKENIZER) -> tuple[str, bool]:
    """Decoded text up to EOS and whether an EOS was present."""
    finished = tokenizer.eos_id in response_tokens
    return tokenizer.decode(response_tokens, stop_at_eos=True), finished


def similarity(text: str, answer: str) -> float:
    """Position-aligned character agreement in [0, 1], normalised by the longer string."""
    longest = max(len(text), len(answer))
    if longest == 0:
        return 1.0
    return sum(1 for a, b in zip(text, answer) if a == b) / longest


def score(meta: Mapping[str, Any], response_tokens: Sequence[int]) -> tuple[float, bool]:
    """``(reward, correct)`` for a response; pure.

    Correct means the text before EOS equals the answer and an EOS was produced: reward 1.0.
    Otherwise the reward is ``INCORRECT_REWARD_SCALE * similarity`` (partial credit for the right
    characters at the right places, and for the right length), so it stays in [0, 0.5].
    """
    text, finished = response_text(response_tokens)
    return score_text(str(meta["answer"]), text, finished)


def score_text(answer: str, text: str, finished: bool) -> tuple[float, bool]:
    """``score`` on decoded text (any tokenizer): ``finished`` says the response ended with EOS."""
    if finished and text == answer:
        return 1.0, True
    return INCORRECT_REWARD_SCALE * similarity(text, answer), False


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


def length_stats(prompts: Sequence[Prompt]) -> dict[str, float]:
    """p50/p90/p99/max/mean of the expected response lengths of ``prompts``."""
    lengths = [float(p.meta["expected_len"]) for p in prompts]
    return {
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": max(lengths),
        "mean": sum(lengths) / len(lengths),
    }


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (same parts -> same seed, on any machine)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
