"""The one quotient both front ends train and report: summed weighted cross entropy over summed target weights.

Why this module exists: a one-pass step equals the N-pass step only when its loss is divided by the
*global* sum of target weights ``W`` of the step (every micro-batch, every process); a held-out loss is
comparable only when it is the same quotient over the whole set. ``onepass train``
(:mod:`onepass.train.run.step`, :mod:`onepass.train.run.evaluation`) and ``OnePassTrainer``
(:mod:`onepass.train.trainer.trainer`) used to write each rule for themselves; both call these now.

Each process adds ``loss_sum_r * world / W`` to its gradients, because DDP (and DeepSpeed, FSDP) average
gradients over processes:

    grad = (1/world) * sum_r d(loss_sum_r * world / W) = d(sum_r loss_sum_r) / W

A step or a set with no target weight trains nothing / has no loss: scale 0 (0/0 would make every gradient
NaN), mean NaN (said as such, never 0.0).

    >>> loss_scale(8.0, 2), loss_scale(0.0, 2)
    (0.25, 0.0)
    >>> weighted_mean(3.0, 4.0), weighted_mean(0.0, 0.0)
    (0.75, nan)
"""

from __future__ import annotations

from typing import overload

import torch


@overload
def loss_scale(weight_sum: float, world: int) -> float: ...
@overload
def loss_scale(weight_sum: torch.Tensor, world: int) -> torch.Tensor: ...


def loss_scale(weight_sum: float | torch.Tensor, world: int) -> float | torch.Tensor:
    """What a process multiplies its loss sum by: ``world / W``, 0 when ``W`` is 0.

    ``weight_sum`` a host float (``onepass train`` knows ``W`` before the step from its units) or a device
    tensor (``OnePassTrainer`` gathers it from the step's batches: no wait for the device)."""
    if isinstance(weight_sum, torch.Tensor):
        return torch.where(weight_sum > 0, world / weight_sum.clamp_min(1e-30), torch.zeros_like(weight_sum))
    return world / weight_sum if weight_sum > 0 else 0.0


def weighted_mean(loss_sum: float, weight_sum: float) -> float:
    """The held-out loss of summed ``loss_sum`` over summed ``weight_sum`` (NaN when nothing was weighted)."""
    return loss_sum / weight_sum if weight_sum > 0 else float("nan")


__all__ = ["loss_scale", "weighted_mean"]
