"""Depth-balanced sampling, the paper's dataset-creation step 1 (``onepass data sample``).

Why this module exists: MathChat_sync is 69% six-turn dialogues. The paper
(appendix; its ``dataset/generate_reasoning.py``) caps depth 6 at 30,000,
then draws a budget of 8,000 stratified by depth (depth = assistant turns)
with at least ``min(200, available)`` per depth. How a share is rounded and
how the minimum combines with it decides the table, so both rules are here,
precisely (``n_d`` = conversations of depth d after the cap, ``N = sum n_d``,
``B`` = budget, ``m`` = minimum):

``rule="paper"`` (default; the authors' code, and what they published)::

    a_d = min(n_d, max(min(m, n_d), floor(n_d * B / N)))

  The minimum is added on top of the proportional share, so the total exceeds
  B: 8,797 on the paper's table, exactly the size of MathChatSync-reasoning.

``rule="exact"`` (the total is exactly ``min(B, N)``)::

    base_d = min(m, n_d)                      (error if sum base_d > B)
    R      = B - sum base_d                   shared in proportion to n_d,
    quota_d = R * n_d / sum_active n_d        capped at the spare n_d - base_d:
                                              a depth whose quota reaches its spare
                                              takes all of it and leaves the active
                                              set; repeat with what is left of R
    a_d    = base_d + floor(quota_d) + 1 for the R - sum floor largest fractional
             parts (largest remainder; ties go to the smaller depth)

Hand-worked example (``tests/data/test_data_sample.py``): n = {1: 5, 2: 40, 3: 100,
4: 15, 5: 2}, B = 50, m = 10::

    paper: floor(n*50/162) = 1 12 30 4 0  -> a = 5 12 30 10 2   (total 59)
    exact: base 5 10 10 10 2 (37), R = 13; depths 1 and 5 have no spare;
           quotas over 155: 3.355 8.387 1.258 -> 3 8 1 (+1 to depth 3)
           -> a = 5 13 19 11 2   (total 50)

Which conversations: within a depth (and for the cap), a uniform sample
drawn with ``random.Random(f"{seed}:{what}:{depth}")``, so the same seed gives
the same sample and one depth's draw does not depend on another's. The
authors' script kept the *first* 30,000 depth-6 dialogues in file order
(``cap_order="first"`` does that). Records are written unchanged, in input order.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onepass.conversation.parse import ConversationError
from onepass.data.sources import iter_conversation_records, write_records
from onepass.errors import DataError, UsageError

# The original MathChat_sync, conversations per depth (the paper's appendix).
PAPER_DEPTHS: dict[int, int] = {
    1: 199, 2: 5339, 3: 990, 4: 2784, 5: 17507, 6: 100443, 7: 13964, 8: 2209, 9: 900, 10: 349,
    11: 149, 12: 63, 13: 41, 14: 15, 15: 9, 16: 7, 17: 1, 18: 4, 19: 2, 21: 2, 23: 1,
}
PAPER_CAPS: dict[int, int] = {6: 30000}
PAPER_BUDGET = 8000
PAPER_MINIMUM = 200
RULES = ("paper", "exact")
CAP_ORDERS = ("random", "first")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocationRow:
    depth: int
    available: int  # before the cap
    pool: int  # after the cap (n_d)
    minimum: int  # min(m, n_d)
    share: float  # proportional share n_d * B / N (paper) or base + quota (exact)
    allocated: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    rows: tuple[AllocationRow, ...]
    budget: int
    minimum: int
    rule: str
    caps: tuple[tuple[int, int], ...] = ()

    @property
    def total(self) -> int:
        return sum(r.allocated for r in self.rows)

    def counts(self) -> dict[int, int]:
        return {r.depth: r.allocated for r in self.rows}

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "budget": self.budget, "minimum": self.minimum,
                "caps": dict(self.caps), "total": self.total, "rows": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        """The allocation as a fixed-width text table with a totals line."""
        head = f"{'depth':>5} {'available':>9} {'after cap':>9} {'minimum':>7} {'share':>9} {'sampled':>7}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.depth:>5} {r.available:>9,} {r.pool:>9,} {r.minimum:>7,} {r.share:>9.2f} "
                         f"{r.allocated:>7,}")
        lines.append("-" * len(head))
        tot = (sum(r.available for r in self.rows), sum(r.pool for r in self.rows),
               sum(r.minimum for r in self.rows), sum(r.share for r in self.rows))
        lines.append(f"{'total':>5} {tot[0]:>9,} {tot[1]:>9,} {tot[2]:>7,} {tot[3]:>9.2f} {self.total:>7,}")
        caps = ", ".join(f"depth {d} -> {c:,}" for d, c in self.caps) or "none"
        lines.append(f"rule {self.rule}, budget {self.budget:,}, minimum min({self.minimum}, available), "
                     f"caps: {caps}")
        return "\n".join(lines)


def largest_remainder(quotas: Mapping[int, float], total: int) -> dict[int, int]:
    """Round ``quotas`` (summing to ``total``) to integers summing to ``total``: floors, then one
    more for the largest fractional parts (ties: smaller key first)."""
    floors = {k: math.floor(q + 1e-9) for k, q in quotas.items()}
    left = total - sum(floors.values())
    assert 0 <= left <= len(quotas), (left, quotas)
    order = sorted(quotas, key=lambda k: (-(quotas[k] - floors[k]), k))
    for k in order[:left]:
        floors[k] += 1
    return floors


def _allocate_paper(n: Mapping[int, int], budget: int, minimum: int) -> tuple[dict[int, int], dict[int, float]]:
    total = sum(n.values())
    share = {d: n[d] * budget / total for d in n}
    # floor(n_d * B / N) in exact integer arithmetic (the authors' int(x) on a positive float)
    alloc = {d: min(n[d], max(min(minimum, n[d]), n[d] * budget // total)) for d in n}
    return alloc, share


def _allocate_exact(n: Mapping[int, int], budget: int, minimum: int) -> tuple[dict[int, int], dict[int, float]]:
    base = {d: min(minimum, n[d]) for d in n}
    if sum(base.values()) > budget:
        raise UsageError(f"the minimums need {sum(base.values()):,} conversations, more than the budget "
                         f"{budget:,}: raise the budget or lower the minimum")
    left = min(budget, sum(n.values())) - sum(base.values())
    extra = {d: 0 for d in n}
    active = {d for d in n if n[d] > base[d]}
    quotas: dict[int, float] = {}
    while active:
        weight = sum(n[d] for d in active)
        quotas = {d: left * n[d] / weight for d in active}
        full = {d for d in active if quotas[d] >= n[d] - base[d]}
        if not full:
            break
        for d in full:
            extra[d] = n[d] - base[d]
            left -= extra[d]
        active -= full
        quotas = {}
    extra.update(largest_remainder(quotas, left) if quotas else {})
    alloc = {d: base[d] + extra[d] for d in n}
    share = {d: base[d] + (quotas[d] if d in quotas else extra[d]) for d in n}
    return alloc, share


def cap_counts(counts: Mapping[int, int], caps: Mapping[int, int] | None) -> dict[int, int]:
    return {d: min(c, (caps or {}).get(d, c)) for d, c in counts.items()}


def allocate(counts: Mapping[int, int], *, budget: int = PAPER_BUDGET, minimum: int = PAPER_MINIMUM,
             caps: Mapping[int, int] | None = None, rule: str = "paper") -> Allocation:
    """How many conversations to draw per depth (see the module docstring for both rules)."""
    if rule not in RULES:
        raise UsageError(f"unknown allocation rule {rule!r}; use one of {', '.join(RULES)}")
    if budget < 0 or minimum < 0 or any(c < 0 for c in counts.values()):
        raise UsageError("budget, minimum and counts must be >= 0")
    if any(c < 0 for c in (caps or {}).values()):
        raise UsageError("caps must be >= 0")
    depths = sorted(d for d, c in counts.items() if c > 0)
    n = {d: v for d, v in cap_counts({d: counts[d] for d in depths}, caps).items()}
    if not depths or sum(n.values()) == 0:
        alloc, share = {d: 0 for d in depths}, {d: 0.0 for d in depths}
    elif rule == "paper":
        alloc, share = _allocate_paper(n, budget, minimum)
    else:
        alloc, share = _allocate_exact(n, budget, minimum)
    rows = tuple(AllocationRow(depth=d, available=counts[d], pool=n[d], minimum=min(minimum, n[d]),
                               share=share[d], allocated=alloc[d]) for d in depths)
    return Allocation(rows=rows, budget=budget, minimum=minimum, rule=rule,
                      caps=tuple(sorted((caps or {}).items())))


def _rng(seed: int, what: str, depth: int) -> random.Random:
    return random.Random(f"onepass-sample:{seed}:{what}:{depth}")


def select(depths: Sequence[int | None], allocation: Allocation, *, seed: int = 0,
           cap_order: str = "random") -> list[int]:
    """Positions (into ``depths``, the depth of each record or None for an invalid one) to keep,
    sorted. Deterministic in ``seed``; each depth draws from its own generator."""
    if cap_order not in CAP_ORDERS:
        raise UsageError(f"unknown cap order {cap_order!r}; use one of {', '.join(CAP_ORDERS)}")
    by_depth: dict[int, list[int]] = {}
    for pos, d in enumerate(depths):
        if d is not None:
            by_depth.setdefault(d, []).append(pos)
    caps = dict(allocation.caps)
    chosen: list[int] = []
    for row in allocation.rows:
        pool = by_depth.get(row.depth, [])
        if len(pool) != row.available:
            raise DataError(f"depth {row.depth}: the allocation was computed for {row.available} "
                             f"conversations but the data has {len(pool)}")
        cap = caps.get(row.depth)
        if cap is not None and len(pool) > cap:
            pool = pool[:cap] if cap_order == "first" else sorted(_rng(seed, "cap", row.depth).sample(pool, cap))
        chosen.extend(_rng(seed, "depth", row.depth).sample(pool, row.allocated))
    return sorted(chosen)


def parse_depth_table(spec: str) -> dict[int, int]:
    """``paper`` or ``"1:199,2:5339,..."`` -> {depth: count}."""
    if spec == "paper":
        return dict(PAPER_DEPTHS)
    return _pairs(spec, ":", "depth table", "DEPTH:COUNT")


def parse_caps(spec: str) -> dict[int, int]:
    """``"6=30000"`` (comma-separated) -> {6: 30000}; ``none`` -> {}."""
    return {} if spec in ("", "none") else _pairs(spec, "=", "cap", "DEPTH=MAX")


def _pairs(spec: str, sep: str, what: str, form: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for part in spec.split(","):
        key, ok, value = part.strip().partition(sep)
        try:
            if not ok:
                raise ValueError
            out[int(key)] = int(value)
        except ValueError:
            raise UsageError(f"bad {what} entry {part.strip()!r}; expected {form}[,{form}...]") from None
    return out


@dataclass(kw_only=True)
class SampleReport:
    allocation: Allocation
    num_records: int = 0  # raw records read (valid or not)
    selected: int = 0
    skipped: list[str] = field(default_factory=list)  # invalid records, with their errors

    def to_dict(self) -> dict[str, Any]:
        return {"allocation": self.allocation.to_dict(), "num_records": self.num_records,
                "selected": self.selected, "skipped": self.skipped}


def record_depths(spec: str | Path, *, strict: bool = True, split: str | None = None,
                  skipped: list[str] | None = None) -> list[int | None]:
    """Pass 1: the depth (assistant turns) of every raw record of ``spec``; None for an invalid one
    (raised with ``strict``, else its error is appended to ``skipped``)."""
    out: list[int | None] = []
    for raw in iter_conversation_records(spec, split=split):
        try:
            out.append(raw.parse().num_assistant_turns)
        except ConversationError as e:
            if strict:
                raise
            out.append(None)
            if skipped is not None:
                skipped.append(str(e))
    return out


def sample_dataset(spec: str | Path, out: str | Path | None, *, budget: int = PAPER_BUDGET,
                   minimum: int = PAPER_MINIMUM, caps: Mapping[int, int] | None = None, rule: str = "paper",
                   seed: int = 0, cap_order: str = "random", strict: bool = True,
                   split: str | None = None) -> SampleReport:
    """Depth-balanced sample of ``spec`` written to ``out`` (.jsonl, records unchanged).

    Two streaming passes: depths first, then the chosen records. ``out=None`` is a dry run.
    """
    skipped: list[str] = []
    depths = record_depths(spec, strict=strict, split=split, skipped=skipped)
    counts = Counter(d for d in depths if d is not None)
    allocation = allocate(counts, budget=budget, minimum=minimum, caps=caps, rule=rule)
    report = SampleReport(allocation=allocation, num_records=len(depths), skipped=skipped)
    if out is None:
        return report
    keep = set(select(depths, allocation, seed=seed, cap_order=cap_order))

    def chosen():
        for pos, raw in enumerate(iter_conversation_records(spec, split=split)):
            if pos in keep:
                yield raw.record

    report.selected = write_records(chosen(), out)
    assert report.selected == allocation.total, (report.selected, allocation.total)
    return report
