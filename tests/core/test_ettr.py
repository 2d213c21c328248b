"""The ETTR ledger: every second in exactly one category; reclassification moves, never creates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlctl.core.ettr import CATEGORIES, EttrLedger

weights = st.dictionaries(st.sampled_from(CATEGORIES), st.floats(0.01, 1.0), min_size=1)


@given(st.lists(st.tuples(st.floats(0.0, 100.0), weights), min_size=1, max_size=50))
def test_categories_sum_to_wall_time(steps: list[tuple[float, dict[str, float]]]) -> None:
    ledger = EttrLedger(started_at=10.0)
    now = 10.0
    for delta, split in steps:
        now += delta
        ledger.advance(now, split)
    assert sum(ledger.seconds.values()) == pytest.approx(now - 10.0, rel=1e-9, abs=1e-6)
    assert 0.0 <= ledger.ettr() <= 1.0 + 1e-9


def test_reclassify_moves_at_most_what_exists() -> None:
    ledger = EttrLedger(started_at=0.0)
    ledger.advance(10.0, {"productive": 1.0})
    assert ledger.reclassify(4.0, "productive", "lost") == 4.0
    assert ledger.reclassify(100.0, "productive", "lost") == 6.0
    assert ledger.seconds["lost"] == 10.0 and ledger.ettr() == 0.0


def test_fractional_seconds_for_partial_impairment() -> None:
    ledger = EttrLedger(started_at=0.0)
    ledger.advance(10.0, {"productive": 0.5, "recovery": 0.5})
    assert ledger.seconds["productive"] == 5.0 and ledger.seconds["recovery"] == 5.0


def test_projection_leaves_the_ledger_unchanged() -> None:
    ledger = EttrLedger(started_at=0.0)
    ledger.advance(5.0, {"init": 1.0})
    projected = ledger.projected(15.0, {"productive": 1.0})
    assert projected.ettr() == pytest.approx(10 / 15)
    assert ledger.last_at == 5.0 and ledger.seconds["productive"] == 0.0
