"""The held-out loss: the weighted mean the steps optimise, over a whole dataset, without gradients.

Why this module exists: an eval loss is comparable with the training loss, and
between one-pass and N-pass, only when it is the same quotient: the summed
weighted cross entropy of every target over the sum of target weights, whatever
the rows, batches or processes (:func:`onepass.loss.batch_loss` gives the sum of
one forward pass). Two ways in:

- :func:`evaluate`, inside a run (:mod:`onepass.train.run.loop`): every process takes
  every world-th unit (:func:`onepass.train.run.data.eval_passes`), the two sums are
  reduced over processes;
- :func:`eval_loss`, for any HF causal LM (or peft model) and prepared rows, one
  process: a saved adapter reloaded reproduces the run's eval loss.

The quotient is :func:`onepass.train.core.normalise.weighted_mean`, which ``OnePassTrainer``'s
evaluation reports too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from onepass.layout.buckets import static_rows
from onepass.loss import ForwardView, batch_loss, layouts_to_batch
from onepass.train.run.compiles import StaticShapes
from onepass.train.config import TrainConfig
from onepass.train.core.normalise import weighted_mean
from onepass.train.run.data import TrainData, eval_passes
from onepass.train.sequence_parallel import ParallelDims, parallel_dims
from onepass.layout.tree import Layout


def evaluate(accelerator: Any, model: Any, data: TrainData, config: TrainConfig,
             dims: ParallelDims | None = None, shapes: StaticShapes | None = None) -> float:
    """Weighted mean loss of ``data``: every process takes every world-th unit; sums are reduced.

    Under DDP the unwrapped module runs (a DDP forward may broadcast buffers, a collective
    that processes with different numbers of passes would not match); sharded models run
    wrapped, with every process padded to the same number of passes. With sequence parallelism
    (``dims``, the run's layout) the ranks of a row take the same units, each adds its shard's loss, one its
    weight.
    ``shapes`` (flex_attention): each pass as one row padded to its length bucket, as the steps run.
    """
    dims = dims or parallel_dims(accelerator, 1)
    world, rank, sharded, shard = dims.dp, dims.dp_rank, dims.sharded, dims.shard
    counts = dims.counts_rows
    unwrapped = accelerator.unwrap_model(model)
    view = ForwardView(model if sharded else unwrapped, unwrapped)

    todo = eval_passes(data, config, rank=rank, world=world, even=sharded)
    was_training = unwrapped.training
    unwrapped.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for group in todo:
            group, length = static_rows(group, shapes.buckets) if shapes is not None else (group, None)
            batch = layouts_to_batch(group, device=accelerator.device, length=length)
            with shapes.forward(length, training=False) if shapes is not None else contextlib.nullcontext():
                total[0] += batch_loss(view, batch, shard=shard).double()
            total[1] += batch["weights"].sum() if counts else 0.0
    total = accelerator.reduce(total, reduction="sum")
    unwrapped.train(was_training)
    return weighted_mean(float(total[0]), float(total[1]))


def eval_loss(model: Any, rows: Sequence[Layout], *, batch_size: int = 1) -> float:
    """Weighted mean loss of ``rows`` for any HF causal LM (or peft model), one process, no grad (NaN for rows
    with no target weight, as in a run)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    num, den = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = layouts_to_batch(rows[start:start + batch_size], device=device)
            num += float(batch_loss(model, batch))
            den += float(batch["weights"].sum())
    model.train(was_training)
    return weighted_mean(num, den)


__all__ = ["eval_loss", "evaluate"]
