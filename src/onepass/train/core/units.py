"""A unit: what a step's order counts and both front ends make of one conversation, the trees of its views.

Why this module exists: ``onepass train`` (:mod:`onepass.train.run.data`) orders its steps over units and
``OnePassTrainer`` (:mod:`onepass.train.trainer.data`) makes one dataset item of each; both prepare a
conversation the same way, one at a time so each tree keeps its conversation, here. A conversation whose
schedule keeps no view makes no unit (its skips are counted in the stats).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onepass.layout.flops import token_ratio
from onepass.layout.tree import Layout
from onepass.prepare.config import DataConfig
from onepass.prepare.guard_sample import ViewSample
from onepass.prepare.parallel import iter_units
from onepass.prepare.pipeline import PrepareStats

Unit = list[Layout]


def conversation_units(conversations: Sequence[Any], tokenizer: Any, config: DataConfig, *,
                       stats: PrepareStats | None = None, progress: bool = False, num_proc: int = 1,
                       sample: ViewSample | None = None) -> tuple[list[Unit], PrepareStats]:
    """One unit per conversation that keeps at least one view: the trees ``config.schedule`` makes.

    Runs :func:`onepass.prepare.pipeline.prepare_conversation` one conversation at a time (on ``num_proc``
    forked workers when > 1, :func:`onepass.prepare.parallel.iter_units`) so each tree keeps its
    conversation; the running totals of ``stats`` add up, the whole-set ones are set at the end.
    ``sample`` is offered each conversation's rendering (the exactness guard's views).
    """
    stats = stats or PrepareStats()
    units: list[Unit] = [trees for trees in iter_units(conversations, tokenizer, config, stats, num_proc=num_proc,
                                                        progress=progress, total=len(conversations), sample=sample)
                         if trees]
    trees = [x for u in units for x in u]
    stats.trees = stats.rows = len(trees)
    stats.row_tokens = sum(len(x) for x in trees)
    stats.padding_tokens, stats.padding_fraction = 0, 0.0
    stats.token_ratio = token_ratio(stats.n_pass_tokens, stats.one_pass_tokens)
    return units, stats


__all__ = ["Unit", "conversation_units"]
