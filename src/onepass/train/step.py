"""One optimizer step whose update equals the N-pass step's: scaled backward, clip, update.

Why this module exists: the one-pass loss equals the N-pass loss for a set of
conversations (:mod:`onepass.loss`), so a training run is equivalent when each
optimizer step (1) covers the same conversations and (2) divides the summed
weighted cross entropy by the same number. (1) is the data order of
:mod:`onepass.train.data`; (2) is the *global* sum of target weights of the
step, over every micro-batch and every process (for token weighting: the
N-pass number of trained tokens). Each process adds ``loss_sum * world / W``
to its gradients, because DDP averages gradients over processes:

    grad = (1/world) * sum_ranks d(loss_sum_r * world / W) = d(sum_r loss_sum_r) / W

So ``schedule: one-pass`` and ``schedule: n-pass`` with one seed take the same
steps (tests: 20 float64 steps, same loss at every step, same final weights),
and 2 processes equal 1 process on the same global batch. The run around the
steps (data, resume, checkpoints, reports) is :mod:`onepass.train.loop`.

Sequence parallelism (``sp_size`` S, :mod:`onepass.ulysses`) changes nothing in that
derivation: the S ranks of a row take the same units (data parallelism is over the
``world / S`` groups), each ``loss_sum_r`` is the sum over its shard's targets, and the
sum over every rank is still the step's loss sum; ``W`` stays the global weight.

A step whose loss or gradient is not finite stops before the update
(:class:`NonFiniteError`): the weights stay those of the last good step.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from onepass.errors import OnePassError
from onepass.flops import visible_pairs
from onepass.loss import ForwardView, batch_loss, layouts_to_batch
from onepass.train.checkpoint import is_sharded
from onepass.train.config import TrainConfig
from onepass.train.data import TrainData, step_passes, step_units, units_per_step
from onepass.train.hyperparams import clip_norm
from onepass.train.sequence_parallel import data_parallel
from onepass.ulysses.comm import SequenceShard


class NonFiniteError(OnePassError):
    """A step whose loss or gradient is NaN or infinite: training stops before it changes the weights."""


class Stepper:
    """One optimizer step: this process's passes, scaled backward, clip, update, reduced metrics."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, data: TrainData,
                 config: TrainConfig, shard: SequenceShard | None = None) -> None:
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.data, self.config, self.shard = data, config, shard
        self.view = ForwardView(model, accelerator.unwrap_model(model))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.data_world, self.data_rank = data_parallel(accelerator, shard)  # the ranks of a row share its units
        self.per_step = units_per_step(config, self.data_world)
        self.even = is_sharded(accelerator)
        self.updating = False  # True inside the parameter update: no checkpoint may be taken then
        self.held: list[int] = []  # stop signals that arrived during the last update (stops_held)

    def __call__(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based); returns its record (``step`` in the record counts from 1)."""
        acc, config, data, device = self.accelerator, self.config, self.data, self.accelerator.device
        t0 = time.perf_counter()
        units = step_units(data.num_units, step, seed=config.seed, per_step=self.per_step, keys=data.keys,
                           window=config.data_config.share_window)
        weight = data.weight_sum(units)  # the same on every process: all hold the whole unit list
        scale = self.world / weight if weight > 0 else 0.0
        passes, num_real = step_passes(data, units, config, rank=self.data_rank, world=self.data_world,
                                       even=self.even)
        counts = self.shard is None or self.shard.rank == 0  # a row's tokens are counted once, not per shard
        # loss sum, tokens, padded tokens, attention pairs a dense kernel computes, visible pairs
        sums = torch.zeros(5, dtype=torch.float64, device=device)
        for i, rows in enumerate(passes):
            batch = layouts_to_batch(rows, device=device)
            with acc.no_sync(self.model) if i < len(passes) - 1 else contextlib.nullcontext():
                loss_sum = batch_loss(self.view, batch, shard=self.shard)
                acc.backward(loss_sum * scale)
            sums[0] += loss_sum.detach().double()
            if i < num_real and counts:
                B, L = batch["input_ids"].shape
                sums[1:] += torch.tensor([sum(len(r) for r in rows), B * L, B * L * L,
                                          sum(visible_pairs(r) for r in rows)], dtype=torch.float64, device=device)
        with stops_held() as self.held:  # a stop inside the update waits for it (deliver_held): whole steps only
            self.updating = True
            clip = clip_norm(config.max_grad_norm)  # None: no clipping (the norm is still measured)
            grad_norm = acc.clip_grad_norm_(self.params, float("inf") if clip is None else clip)
            if not (math.isfinite(float(grad_norm)) and math.isfinite(float(sums[0]))):
                self.optimizer.zero_grad(set_to_none=True)  # the weights are still those of the last good step
                self.updating = False
                raise NonFiniteError(f"step {step + 1}: the loss is {float(sums[0])} and the gradient norm "
                                     f"{float(grad_norm)}; the run stops before the update (a checkpoint keeps "
                                     "the last good step): lower the learning rate or check the data and dtype")
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.updating = False
        sums = acc.reduce(sums, reduction="sum")
        seconds = time.perf_counter() - t0
        return {"step": step + 1, "epoch": (step + 1) * self.per_step / data.num_units,
                "loss": float(sums[0]) / weight if weight > 0 else 0.0, "grad_norm": float(grad_norm),
                "lr": self.scheduler.get_last_lr()[0], "target_weight": weight, "tokens": int(sums[1]),
                "padded_tokens": int(sums[2]), "dense_pairs": int(sums[3]), "visible_pairs": int(sums[4]),
                "seconds": seconds, "tokens_per_s": float(sums[1]) / seconds if seconds > 0 else 0.0}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stops_held() -> Iterator[list[int]]:
    """Ctrl-C or SIGTERM arriving inside the block are held, not handled: the list yielded collects them, for
    :func:`deliver` to hand to the handlers in place once the step they interrupted is counted.

    The parameter update (clip, optimizer and scheduler step) must run whole: a stop that landed inside it
    used to leave no checkpoint at all (half-updated weights cannot be saved), and with a large optimizer
    state the update is a good part of each step. Main thread only (where signals are handled)."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    before = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in STOP_SIGNALS}
    try:
        yield caught
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def deliver(held: list[int]) -> None:
    """The first held stop signal, now, to the handler in place (KeyboardInterrupt, Terminated); the list empties."""
    if held:
        signum = held[0]
        held.clear()
        signal.raise_signal(signum)


__all__ = ["NonFiniteError", "STOP_SIGNALS", "Stepper", "deliver", "stops_held"]
