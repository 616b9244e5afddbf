"""Depth-balanced sampling: hand-computed allocation tables, the paper's table, reproducibility."""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.data.sample import (
    PAPER_CAPS,
    PAPER_DEPTHS,
    allocate,
    largest_remainder,
    parse_caps,
    parse_depth_table,
    record_depths,
    sample_dataset,
    select,
)
from onepass.data.synthetic import PAPER_SAMPLED_DEPTHS

SMALL = {1: 5, 2: 40, 3: 100, 4: 15, 5: 2}


def test_paper_rule_by_hand():
    # N = 162, floor(n * 50 / 162) = 1 12 30 4 0, raised to min(10, n) = 5 10 10 10 2
    alloc = allocate(SMALL, budget=50, minimum=10, rule="paper")
    assert alloc.counts() == {1: 5, 2: 12, 3: 30, 4: 10, 5: 2}
    assert alloc.total == 59


def test_exact_rule_by_hand():
    # base 5 10 10 10 2 (37), R = 13; depths 1 and 5 have no spare; quotas over 40+100+15 = 155:
    # 13*40/155 = 3.355, 13*100/155 = 8.387, 13*15/155 = 1.258 -> floors 3 8 1, +1 to depth 3 (.387)
    alloc = allocate(SMALL, budget=50, minimum=10, rule="exact")
    assert alloc.counts() == {1: 5, 2: 13, 3: 19, 4: 11, 5: 2}
    assert alloc.total == 50


def test_exact_rule_redistributes_what_a_capped_depth_cannot_take():
    # n = {1: 10, 2: 12, 3: 100}, m = 5: base 5 5 5, spare 5 7 95.
    # B = 100: R = 85, quotas 85*n/122 = 6.97 8.36 69.7: depths 1 and 2 reach their spare and take
    # all of it (10, 12); depth 3 gets base 5 + the remaining 85 - 12 = 73 -> 78.
    a = allocate({1: 10, 2: 12, 3: 100}, budget=100, minimum=5, rule="exact").counts()
    assert a == {1: 10, 2: 12, 3: 78}
    b = allocate({1: 10, 2: 12, 3: 100}, budget=60, minimum=5, rule="exact").counts()
    # B = 60: R = 45, quotas 3.689 4.426 36.885, none capped; floors 3 4 36 (43), the 2 left go to
    # the largest fractions .885 (depth 3) and .689 (depth 1)
    assert b == {1: 9, 2: 9, 3: 42}


def test_cap_applies_before_allocation():
    alloc = allocate({1: 50, 2: 1000}, budget=100, minimum=20, caps={2: 150}, rule="paper")
    assert [(r.available, r.pool) for r in alloc.rows] == [(50, 50), (1000, 150)]
    assert alloc.counts() == {1: 25, 2: 75}  # floor(50*100/200), floor(150*100/200)


def test_budget_above_the_pool_takes_everything():
    for rule in ("paper", "exact"):
        assert allocate({1: 3, 2: 4}, budget=100, minimum=2, rule=rule).counts() == {1: 3, 2: 4}


def test_minimums_over_budget_is_an_error_for_the_exact_rule():
    with pytest.raises(ValueError, match="minimums need 30"):
        allocate({1: 10, 2: 10, 3: 10}, budget=20, minimum=10, rule="exact")


def test_the_paper_table_gives_the_published_size():
    alloc = allocate(PAPER_DEPTHS, budget=8000, minimum=200, caps=PAPER_CAPS, rule="paper")
    assert sum(PAPER_DEPTHS.values()) == 144_978  # MathChat_sync as the dataset card counts it
    assert sum(r.pool for r in alloc.rows) == 74_535
    assert alloc.total == 8_797  # MathChatSync-reasoning has 8,797 conversations
    assert alloc.counts() == PAPER_SAMPLED_DEPTHS
    exact = allocate(PAPER_DEPTHS, budget=8000, minimum=200, caps=PAPER_CAPS, rule="exact")
    assert exact.total == 8000
    assert all(r.allocated >= min(200, r.pool) for r in exact.rows)
    table = alloc.table()
    assert "8,797" in table and "100,443" in table and "30,000" in table


def test_largest_remainder_ties_go_to_the_smaller_key():
    assert largest_remainder({1: 0.5, 2: 0.5, 3: 1.0}, 2) == {1: 1, 2: 0, 3: 1}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 30), st.integers(0, 500), min_size=1, max_size=12),
       st.integers(0, 3000), st.integers(0, 50))
def test_exact_rule_invariants(counts, budget, minimum):
    base = sum(min(minimum, c) for c in counts.values())
    if base > budget:
        with pytest.raises(ValueError):
            allocate(counts, budget=budget, minimum=minimum, rule="exact")
        return
    alloc = allocate(counts, budget=budget, minimum=minimum, rule="exact")
    assert alloc.total == min(budget, sum(counts.values()))
    for r in alloc.rows:
        assert min(minimum, r.pool) <= r.allocated <= r.pool


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 30), st.integers(0, 500), min_size=1, max_size=12),
       st.integers(0, 3000), st.integers(0, 50))
def test_paper_rule_invariants(counts, budget, minimum):
    alloc = allocate(counts, budget=budget, minimum=minimum, rule="paper")
    n = sum(counts.values())
    for r in alloc.rows:
        assert min(minimum, r.pool) <= r.allocated <= r.pool
        assert r.allocated >= min(r.pool, r.pool * budget // n)


def test_select_is_reproducible_and_respects_the_allocation():
    depths = [1 + (i * 7) % 5 for i in range(400)] + [None, None]  # two invalid records
    counts = collections.Counter(d for d in depths if d is not None)
    alloc = allocate(counts, budget=60, minimum=5, caps={3: 30}, rule="exact")
    a = select(depths, alloc, seed=1)
    assert a == select(depths, alloc, seed=1)
    assert a != select(depths, alloc, seed=2)
    assert a == sorted(set(a)) and len(a) == alloc.total == 60
    assert collections.Counter(depths[i] for i in a) == collections.Counter(alloc.counts())
    first = select(depths, allocate(counts, budget=400, minimum=5, caps={3: 30}), seed=1, cap_order="first")
    assert [i for i in first if depths[i] == 3] == [i for i, d in enumerate(depths) if d == 3][:30]


def _conv(depth: int, i: int) -> dict:
    turns = []
    for k in range(depth):
        turns += [{"from": "human", "value": f"q{i}.{k}"}, {"from": "gpt", "value": f"a{i}.{k}", "reasoning": "r"}]
    return {"conversations": turns, "id": i}


def test_sample_dataset_writes_the_allocation_and_keeps_records_unchanged(tmp_path):
    depths = [1] * 30 + [2] * 50 + [3] * 120 + [5] * 4
    records = [_conv(d, i) for i, d in enumerate(depths)]
    data = tmp_path / "pool.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + "{bad json\n")
    out = tmp_path / "sampled.jsonl"
    report = sample_dataset(data, out, budget=40, minimum=8, caps={3: 60}, rule="exact", seed=3, strict=False)
    assert report.num_records == len(records) + 1 and len(report.skipped) == 1 and "line 205" in report.skipped[0]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == report.selected == report.allocation.total == 40
    assert all(g == records[g["id"]] for g in got)  # ShareGPT shape and fields as they were
    assert [g["id"] for g in got] == sorted(g["id"] for g in got)  # input order
    by_depth = collections.Counter(depths[g["id"]] for g in got)
    assert by_depth == collections.Counter(report.allocation.counts())
    again = tmp_path / "again.jsonl"
    sample_dataset(data, again, budget=40, minimum=8, caps={3: 60}, rule="exact", seed=3, strict=False)
    assert again.read_bytes() == out.read_bytes()
    assert record_depths(out) == [depths[g["id"]] for g in got]


def test_parsers():
    assert parse_depth_table("1:3, 2:5") == {1: 3, 2: 5}
    assert parse_depth_table("paper") == PAPER_DEPTHS
    assert parse_caps("6=30000,7=10") == {6: 30000, 7: 10} and parse_caps("none") == {}
    with pytest.raises(ValueError, match="DEPTH=MAX"):
        parse_caps("6:30000")
