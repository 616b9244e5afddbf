"""Schedules: which views of a conversation share a tree, and how targets are weighted.

Why this module exists: N-pass, one-pass, the paper's K-pass and a token
budget are the same method with a different grouping of views, so they are
one function here. For a conversation with 5 views::

    n-pass      [0] [1] [2] [3] [4]          one tree per view (the baseline)
    one-pass    [0 1 2 3 4]                  one tree per conversation
    k-pass:2    [0 1 2] [3 4]                K contiguous groups (paper, appendix)
    budget      [0 1 2 3] [4]                greedy contiguous groups whose tree
                                             fits max_tokens (split, never dropped)

Weighting (the per-target loss weight, summed by the loss):

    token         1                          sum over trained tokens (the theorem's loss)
    turn          1 / tokens of its view     each view's tokens averaged
    conversation  1 / tokens of its conv.    each conversation's tokens averaged

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from onepass.errors import UsageError
from onepass.layout.tree import Layout, PrefixTree
from onepass.layout.view import Unmeasured, View, over_budget

WEIGHTINGS = ("token", "turn", "conversation")


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    kind: str  # n-pass | one-pass | k-pass | budget
    k: int = 0

    def __str__(self) -> str:
        return f"k-pass:{self.k}" if self.kind == "k-pass" else self.kind


def parse_schedule(spec: str) -> Schedule:
    """``n-pass``, ``one-pass``, ``k-pass:K`` (K >= 1) or ``budget``."""
    if spec in ("n-pass", "one-pass", "budget"):
        return Schedule(kind=spec)
    if spec.startswith("k-pass:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return Schedule(kind="k-pass", k=k)
    raise UsageError(f"unknown schedule {spec!r}; use n-pass, one-pass, k-pass:K (K >= 1) or budget")


def view_weights(views: Sequence[View], weighting: str) -> list[float]:
    """Per-target weight of each view of one conversation."""
    if weighting == "token":
        return [1.0] * len(views)
    if weighting == "turn":
        return [1.0 / v.num_completion for v in views]
    if weighting == "conversation":
        total = sum(v.num_completion for v in views)
        return [1.0 / total] * len(views)
    raise UsageError(f"unknown weighting {weighting!r}; use one of {', '.join(WEIGHTINGS)}")


def contiguous_groups(n: int, k: int) -> list[list[int]]:
    """Split ``range(n)`` into ``min(k, n)`` contiguous groups, sizes differing by at most one."""
    return [list(map(int, g)) for g in np.array_split(np.arange(n), min(k, n)) if len(g)]


@dataclass(kw_only=True, slots=True)
class Scheduled:
    """The trees of one conversation, and what had to be left out (with reasons)."""

    layouts: list[Layout] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # view indices per tree
    skipped: list[str] = field(default_factory=list)
    skipped_views: list[int] = field(default_factory=list)  # how many views each message of ``skipped`` covers
    num_views_skipped: int = 0
    weights: dict[int, float] = field(default_factory=dict)  # view index -> its per-target weight in its tree


def schedule_views(views: Sequence[View | Unmeasured], schedule: Schedule, *, weighting: str = "token",
                   max_tokens: int | None = None) -> Scheduled:
    """Group the views of one conversation into trees and lay each tree out.

    A view longer than ``max_tokens`` on its own is skipped and reported. Under
    ``budget`` the rest is split so every tree fits; under the other schedules
    a tree over ``max_tokens`` is skipped and reported (use ``budget`` to split).
    """
    out = Scheduled()
    kept = []
    for i, v in enumerate(views):
        if max_tokens is not None and (isinstance(v, Unmeasured) or len(v) > max_tokens):
            out.skipped.append(over_budget(v, max_tokens))
            out.skipped_views.append(1)
            out.num_views_skipped += 1
        else:
            kept.append(i)
    if not kept:
        return out
    weights = out.weights = dict(zip(kept, view_weights([views[i] for i in kept], weighting)))

    built: list[PrefixTree] = []  # the budget's trees, grown while grouping (not built twice)
    if schedule.kind == "budget":
        if max_tokens is None:
            groups = [kept]
        else:
            groups, tree, current = [], PrefixTree(), []
            for i in kept:
                if current and len(tree) + tree.count_new(views[i]) > max_tokens:
                    groups.append(current)
                    built.append(tree)
                    tree, current = PrefixTree(), []
                tree.insert(views[i], weights[i])
                current.append(i)
            groups.append(current)
            built.append(tree)
    elif schedule.kind == "n-pass":
        groups = [[i] for i in kept]
    elif schedule.kind == "one-pass":
        groups = [kept]
    elif schedule.kind == "k-pass":
        groups = [[kept[j] for j in g] for g in contiguous_groups(len(kept), schedule.k)]
    else:
        raise ValueError(f"unknown schedule {schedule}")

    for g, group in enumerate(groups):
        if built:
            tree = built[g]
        else:
            tree = PrefixTree()
            for i in group:
                tree.insert(views[i], weights[i])
        if max_tokens is not None and len(tree) > max_tokens:
            first = views[group[0]]
            out.skipped.append(f"{first.source}: {schedule} tree of {len(group)} views has {len(tree)} "
                               f"tokens, more than max_tokens={max_tokens} (use --schedule budget to split)")
            out.skipped_views.append(len(group))
            out.num_views_skipped += len(group)
            continue
        out.layouts.append(tree.layout())
        out.groups.append(list(group))
    return out
