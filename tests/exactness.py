"""Shared float64 equivalence helpers: a run's loss and every gradient, their largest relative
difference, the N-pass reference and the same loss laid out as trees (tests/test_architectures.py,
tests/mixers/test_hybrids.py)."""

from __future__ import annotations

import torch

from onepass.loss import batch_loss, layout_loss, layouts_to_batch, view_loss_reference
from onepass.layout.pack import pack_layouts
from onepass.layout.schedule import parse_schedule, schedule_views


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def max_rel_diff(got, want):
    (loss_got, grads_got), (loss_want, grads_want) = got, want
    worst = abs(loss_got - loss_want) / abs(loss_want)
    for g, w in zip(grads_got, grads_want, strict=True):
        worst = max(worst, ((g - w).norm() / w.norm().clamp_min(1e-300)).item())
    return worst


def n_pass(model, views):
    return lambda: sum(view_loss_reference(model, v) for vs in views for v in vs)


def tree_runs(model, views, *, pack_k_pass: bool = False, slack: int = 60):
    """The same loss three ways: one-pass trees, k-pass:2 trees, and packed rows of different
    lengths (so padded): the one-pass trees, plus the k-pass:2 ones when ``pack_k_pass`` (then the
    packed loss counts every view twice and is halved). Rows hold the longest tree + ``slack``."""
    def scheduled(spec):
        return [x for vs in views for x in schedule_views(vs, parse_schedule(spec)).layouts]

    one = scheduled("one-pass")
    packed = one + scheduled("k-pass:2") if pack_k_pass else one
    rows = pack_layouts(packed, max(map(len, one)) + slack)
    assert len(rows) >= 2 and len({len(r) for r in rows}) >= 2  # a real batch, padded
    copies = 2 if pack_k_pass else 1
    return {"one-pass": lambda: sum(layout_loss(model, x) for x in one),
            "k-pass:2": lambda: sum(layout_loss(model, x) for x in scheduled("k-pass:2")),
            "packed": lambda: batch_loss(model, layouts_to_batch(rows)) / copies}
