"""Measured equivalence: the one-pass loss and gradients against plain N-pass forwards.

Why this module exists: the method's promise is that the loss is *identical*
to training every view on its own. ``verify`` checks it on the user's own
data, tokenizer and model: it runs every view as a plain HF forward (the
N-pass reference, :func:`onepass.loss.view_loss_reference`), then the
scheduled trees (:func:`onepass.loss.layout_loss`), and compares the summed
losses and every parameter's gradient.

With a tiny random model the vocabulary is compacted first (the ids that
occur are renumbered 0..V-1, the same map for both sides), so a 151k-token
vocabulary costs nothing; the layout under test is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from onepass.errors import DataError
from onepass.guard.divergence import max_rel_grad_diff
from onepass.loss import layout_loss, view_loss_reference
from onepass.pack import pack_layouts
from onepass.schedule import Schedule, parse_schedule, schedule_views, view_weights
from onepass.share import share_rows
from onepass.view import View
from onepass.vocab import remap, used_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    loss_n_pass: float
    loss_one_pass: float
    max_abs_loss_diff: float
    rel_loss_diff: float
    max_rel_grad_diff: float
    num_conversations: int
    num_views: int
    num_trees: int
    n_pass_tokens: int
    one_pass_tokens: int
    schedule: str
    weighting: str
    dtype: str
    worst_parameter: str = ""  # the parameter with the largest relative gradient difference
    packed: bool = False  # the trees of all conversations were packed into shared rows
    shared: bool = False  # ... and trees of conversations that share a prefix merged into one (onepass.share)
    num_rows: int = 0
    row_tokens: int = 0  # tokens of the rows run (the trees', less the prefixes shared)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact_vocab(conversations: Sequence[Sequence[View]]) -> tuple[list[list[View]], int]:
    """Renumber the token ids that occur to 0..V-1 (one map for all views, :mod:`onepass.vocab`)."""
    used = used_ids(v.tokens for views in conversations for v in views)
    out = [[replace(v, tokens=remap(v.tokens, used)) for v in views] for views in conversations]
    return out, len(used)


def parameter_grads(model: Any) -> dict[str, torch.Tensor]:
    """A copy of every trainable parameter's gradient (zeros where there is none)."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def run_verify(conversations: Sequence[Sequence[View]], model: Any, *,
               schedule: Schedule | str = "one-pass", weighting: str = "token",
               max_tokens: int | None = None, pack: bool = False, share: bool = False) -> VerifyReport:
    """Loss and gradients of N-pass vs ``schedule`` on the same views and model.

    ``pack``: the trees of all conversations are packed into rows of at most ``max_tokens``
    (one row when it is None), so documents share rows as in packed training; ``share`` (with
    ``pack``, under any schedule but n-pass): trees of conversations that share a token prefix are
    merged into one tree per row (:mod:`onepass.share`), as ``prepare --pack`` does by default.
    """
    if isinstance(schedule, str):
        schedule = parse_schedule(schedule)
    if not any(len(views) for views in conversations):
        raise DataError("verify checked nothing: no view to compare (a verdict on nothing is no verdict)")
    model.zero_grad(set_to_none=True)
    loss_n = 0.0
    num_views = n_tokens = 0
    for views in conversations:
        for view, w in zip(views, view_weights(views, weighting)):
            loss = view_loss_reference(model, view, w)
            loss.backward()
            loss_n += loss.item()
            num_views += 1
            n_tokens += len(view)
    grads_n = parameter_grads(model)

    model.zero_grad(set_to_none=True)
    loss_1 = 0.0
    trees, units = [], []
    for c, views in enumerate(conversations):
        scheduled = schedule_views(views, schedule, weighting=weighting, max_tokens=max_tokens)
        if scheduled.skipped:
            raise DataError("verify needs every view trained; skipped: " + "; ".join(scheduled.skipped))
        trees.extend(scheduled.layouts)
        units.extend([c] * len(scheduled.layouts))
    budget = max_tokens or sum(len(x) for x in trees)
    shared = pack and share and schedule.kind != "n-pass"
    if shared:
        rows = share_rows(trees, units, budget)
    else:
        rows = pack_layouts(trees, budget) if pack else trees
    for layout in rows:
        loss = layout_loss(model, layout)
        loss.backward()
        loss_1 += loss.item()
    grads_1 = parameter_grads(model)
    model.zero_grad(set_to_none=True)

    rel_grad, worst = max_rel_grad_diff(grads_n, grads_1)
    abs_diff = abs(loss_1 - loss_n)
    return VerifyReport(
        loss_n_pass=loss_n, loss_one_pass=loss_1, max_abs_loss_diff=abs_diff,
        rel_loss_diff=abs_diff / abs(loss_n) if loss_n else (0.0 if abs_diff == 0 else math.inf),
        max_rel_grad_diff=rel_grad, num_conversations=len(conversations), num_views=num_views,
        num_trees=len(trees), n_pass_tokens=n_tokens, one_pass_tokens=sum(len(x) for x in trees),
        schedule=str(schedule), weighting=weighting, dtype=str(next(model.parameters()).dtype),
        worst_parameter=worst, packed=pack, shared=shared, num_rows=len(rows),
        row_tokens=sum(len(x) for x in rows))
