"""One optimizer step whose update equals the N-pass step's: scaled backward, clip, update.

Why this module exists: the one-pass loss equals the N-pass loss for a set of
conversations (:mod:`onepass.loss`), so a training run is equivalent when each
optimizer step (1) covers the same conversations and (2) divides the summed
weighted cross entropy by the same number. (1) is the data order of
:mod:`onepass.train.run.data`; (2) is the *global* sum of target weights of the
step, over every micro-batch and every process (for token weighting: the
N-pass number of trained tokens). Each process adds ``loss_sum * world / W``
to its gradients (:func:`onepass.train.core.normalise.loss_scale`, which ``OnePassTrainer``
calls too), because DDP averages gradients over processes:

    grad = (1/world) * sum_ranks d(loss_sum_r * world / W) = d(sum_r loss_sum_r) / W

So ``schedule: one-pass`` and ``schedule: n-pass`` with one seed take the same
steps (tests: 20 float64 steps, same loss at every step, same final weights),
and 2 processes equal 1 process on the same global batch. The run around the
steps (data, resume, checkpoints, reports) is :mod:`onepass.train.run.loop`.

Sequence parallelism (``sp_size`` S, :mod:`onepass.parallel`) changes nothing in that
derivation: the S ranks of a row take the same units (data parallelism is over the
``world / S`` groups), each ``loss_sum_r`` is the sum over its shard's targets, and the
sum over every rank is still the step's loss sum; ``W`` stays the global weight.

A step whose loss or gradient is not finite stops before the update
(:class:`NonFiniteError`): the weights stay those of the last good step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.batch import to_device
from onepass.errors import OnePassError
from onepass.layout.buckets import static_rows
from onepass.layout.flops import visible_pairs
from onepass.loss import ForwardView, batch_loss, layouts_to_batch
from onepass.model.private_names import find_private
from onepass.train.run.compiles import StaticShapes
from onepass.train.config import TrainConfig
from onepass.train.core.normalise import loss_scale
from onepass.train.run.data import TrainData, step_passes, step_units, units_per_step
from onepass.train.hyperparams import clip_norm
from onepass.train.sequence_parallel import ParallelDims, parallel_dims
from onepass.train.run.signals import stops_held


class NonFiniteError(OnePassError):
    """A step whose loss or gradient is NaN or infinite: training stops before it changes the weights.
    ``step``: that step (1-based); the run's last good step is the one before it."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


SKIP_ON_DEVICE = "torch.optim fused step skip (found_inf)"  # the private name of the device-side guard


@dataclass(frozen=True, kw_only=True)
class Launched:
    """A step whose work is queued on the device, its numbers not read yet (:meth:`Stepper.settle` reads them).

    ``numbers``: [loss sum, gradient norm, finite, tokens, padded tokens, dense pairs, visible pairs] of the
    step over every process, copied (without waiting) to host memory as the step's last work; ``done``: the event that marks that copy (None on CPU: already there).
    ``restore``: the scheduler's state and the learning rates before this step, put back if it is not
    finite (its update was skipped on the device, and every later one).
    """

    step: int  # 0-based
    started: float  # perf_counter at launch
    weight: float  # the step's target weight sum (the normaliser), the same on every process
    numbers: torch.Tensor
    done: Any
    lr: float
    restore: tuple[dict[str, Any], list[float]]
    compiles: int | None  # flex_attention: kernels compiled during the step (0 once its length bucket has run)


class Stepper:
    """One optimizer step: this process's passes, scaled backward, clip, update, reduced metrics.

    :meth:`launch` queues a step on the device and returns without waiting for it: its masks, chains and
    target positions are planned on the host (:mod:`onepass.batch`), its non-finite guard runs on the
    device (the optimizer's update is skipped there, :meth:`_skips_on_device`), its numbers are copied back
    without waiting. :meth:`settle` reads them once they are there; the loop launches step k + 1 before
    it settles step k, so the host plans the next step while the device runs this one. Calling the
    stepper is the two at once (tests, the bench).
    """

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, data: TrainData,
                 config: TrainConfig, dims: ParallelDims | None = None) -> None:
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.dims = dims or parallel_dims(accelerator, 1)  # the run's layout (onepass.train.sequence_parallel)
        self.data, self.config, self.shard = data, config, self.dims.shard
        self.view = ForwardView(model, accelerator.unwrap_model(model))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.data_world, self.data_rank = self.dims.dp, self.dims.dp_rank  # the ranks of a row share its units
        self.per_step = units_per_step(config, self.data_world)
        self.even = self.dims.sharded
        self.updating = False  # True inside the parameter update: no checkpoint may be taken then
        self.held: list[int] = []  # stop signals that arrived during the last update (stops_held)
        self.device_guard = self._skips_on_device()
        self.shapes: StaticShapes | None = None  # flex_attention: each forward in a length bucket (the loop sets it)
        self._bad: torch.Tensor | None = None  # device flag: a step so far was not finite (sticky)
        self._settled_at = 0.0  # when the last settled step's numbers were read

    def __call__(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based) and read it: its record (``step`` in the record counts from 1)."""
        return self.settle(self.launch(step))

    def _skips_on_device(self) -> bool:
        """Whether a non-finite step's update can be skipped on the device: torch's fused optimizers take a
        ``found_inf`` flag (as torch's GradScaler hands them) and then change nothing, step counts included.
        Else (bitsandbytes, an fp16 GradScaler that sets its own flag) the guard reads the numbers before
        the update, as it always did: one wait per step."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        return (find_private(SKIP_ON_DEVICE) is not None and getattr(self.accelerator, "scaler", None) is None
                and bool(getattr(inner, "_step_supports_amp_scaling", False)))

    def launch(self, step: int) -> Launched:
        """Queue step ``step`` (0-based): forward and backward of this process's passes, the reduction of its
        numbers, the clip and the update (skipped on the device when not finite); nothing waits for the device."""
        config, data = self.config, self.data
        started = time.perf_counter()
        units = step_units(data.num_units, step, seed=config.seed, per_step=self.per_step, keys=data.keys,
                           window=config.data_config.share_window)
        weight = data.weight_sum(units)  # the same on every process: all hold the whole unit list
        compiled = self.shapes.total if self.shapes is not None else 0
        sums = self._passes(units, scale=loss_scale(weight, self.world))
        with stops_held() as self.held:  # a stop inside the update waits for it (deliver_held): whole steps only
            self.updating = True
            restore = (self.scheduler.state_dict(), [g["lr"] for g in self.optimizer.param_groups])
            numbers = self._update(step, weight, sums)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            copied, done = _copy_to_host(numbers)
            self.updating = False
        return Launched(step=step, started=started, weight=weight, numbers=copied, done=done,
                        lr=self.scheduler.get_last_lr()[0], restore=restore,
                        compiles=self.shapes.total - compiled if self.shapes is not None else None)

    def _passes(self, units: Any, *, scale: float) -> torch.Tensor:
        """Forward and scaled backward of this process's passes of ``units``; their loss sum and host counts
        (tokens, padded tokens, pairs a dense kernel computes, visible pairs), summed over every process (a
        collective, not a wait)."""
        acc, device = self.accelerator, self.accelerator.device
        passes, num_real = step_passes(self.data, units, self.config, rank=self.data_rank, world=self.data_world,
                                       even=self.even)
        counts = self.dims.counts_rows  # a row's tokens are counted once, not per shard
        host, loss_sum = np.zeros(4), None
        for i, rows in enumerate(passes):
            rows, length = static_rows(rows, self.shapes.buckets) if self.shapes is not None else (rows, None)
            batch = layouts_to_batch(rows, device=device, length=length)
            with (acc.no_sync(self.model) if i < len(passes) - 1 else contextlib.nullcontext(),
                  self.shapes.forward(length) if self.shapes is not None else contextlib.nullcontext()):
                part = batch_loss(self.view, batch, shard=self.shard)
                acc.backward(part * scale)
            loss_sum = part.detach().double() if loss_sum is None else loss_sum + part.detach().double()
            if i < num_real and counts:
                B, L = batch["input_ids"].shape
                host += [sum(len(r) for r in rows), B * L, B * L * L, sum(visible_pairs(r) for r in rows)]
        return acc.reduce(torch.cat([loss_sum.reshape(1), to_device(host, device)]), reduction="sum")

    def _update(self, step: int, weight: float, sums: torch.Tensor) -> torch.Tensor:
        """Clip and update, the update skipped on the device unless the loss sum and the gradient norm are finite
        (and every later one: the flag is sticky until :meth:`settle` reads it); the step's numbers
        ``[loss sum, gradient norm, finite, *counts]``."""
        clip = clip_norm(self.config.max_grad_norm)  # None: no clipping (the norm is still measured)
        grad_norm = self.accelerator.clip_grad_norm_(self.params, float("inf") if clip is None else clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor (its whole value: a collective, not a wait)
            grad_norm = grad_norm.full_tensor()
        grad_norm = torch.as_tensor(grad_norm, device=sums.device)
        finite = torch.isfinite(sums[0]) & torch.isfinite(grad_norm)
        numbers = torch.cat([torch.stack([sums[0], grad_norm.double(), finite.double()]), sums[1:]])
        if not self.device_guard:  # the guard reads the numbers first (bitsandbytes, fp16's GradScaler)
            self._check(step, weight, numbers.cpu())
            self.optimizer.step()
            return numbers
        self._bad = ~finite if self._bad is None else self._bad | ~finite
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the optimizer
        inner.found_inf = self._bad.float()  # the fused step changes nothing while it is set
        try:
            self.optimizer.step()
        finally:
            del inner.found_inf
        return numbers

    def settle(self, launched: Launched) -> dict[str, Any]:
        """The record of ``launched`` once its numbers are on the host (waiting for that step only); a step that
        was not finite raises :class:`NonFiniteError`, with the scheduler and learning rates put back to
        before it (its update, and every one launched after it, were skipped on the device)."""
        if launched.done is not None:
            launched.done.synchronize()
        loss_sum, grad_norm, finite, *counts = launched.numbers.tolist()
        if not finite:
            state, lrs = launched.restore
            self.scheduler.load_state_dict(state)
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            self._bad = None
            self.optimizer.zero_grad(set_to_none=True)
            self._check(launched.step, launched.weight, launched.numbers)
        now = time.perf_counter()
        seconds = now - max(launched.started, self._settled_at)  # the time this step added to the run
        self._settled_at = now
        weight, step = launched.weight, launched.step
        record = {"step": step + 1, "epoch": (step + 1) * self.per_step / self.data.num_units,
                  "loss": loss_sum / weight if weight > 0 else 0.0, "grad_norm": grad_norm,
                  "lr": launched.lr, "target_weight": weight, "tokens": int(counts[0]),
                  "padded_tokens": int(counts[1]), "dense_pairs": int(counts[2]), "visible_pairs": int(counts[3]),
                  "seconds": seconds, "tokens_per_s": counts[0] / seconds if seconds > 0 else 0.0}
        if launched.compiles is not None:
            record["compiles"] = launched.compiles
        return record

    def _check(self, step: int, weight: float, numbers: torch.Tensor) -> None:
        """:class:`NonFiniteError` for step ``step`` unless its loss sum and gradient norm (host) are finite."""
        loss_sum, grad_norm = float(numbers[0]), float(numbers[1])
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):
            return
        self.optimizer.zero_grad(set_to_none=True)  # the weights are still those of the last good step
        self.updating = False
        raise NonFiniteError(f"step {step + 1}: the loss is {loss_sum / weight if weight > 0 else loss_sum} and the "
                             f"gradient norm {grad_norm}; the run stops before the update (a checkpoint keeps the "
                             "last good step): lower the learning rate or check the data and dtype", step=step + 1)


class InFlight:
    """The steps a run has launched and not read yet, oldest first (at most two): step k is read once step k + 1
    is queued behind it, so the host plans a step while the device runs the one before."""

    def __init__(self, stepper: Stepper) -> None:
        self.stepper, self.unread = stepper, []

    def launch(self, step: int) -> None:
        self.unread.append(self.stepper.launch(step))

    def ready(self, *, now: bool = False) -> Iterator[dict[str, Any]]:
        """The records to read: every step but the last launched, and that one too when ``now`` (an eval, a
        checkpoint or the end follows it)."""
        while len(self.unread) > 1 or (self.unread and now):
            record = self.stepper.settle(self.unread[0])
            self.unread.pop(0)
            yield record

    def drain(self, logged: Callable[[dict[str, Any]], Any]) -> NonFiniteError | None:
        """On a stop: every launched step read and ``logged`` (unless the stop landed inside an update); the
        first that was not finite, if one was."""
        try:
            while self.unread and not self.stepper.updating:
                logged(next(self.ready(now=True)))
        except NonFiniteError as bad:
            return bad
        return None


def _copy_to_host(numbers: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``numbers`` copied to host memory without waiting, and the CUDA event that marks the copy done (None
    off CUDA: on CPU they are there, elsewhere the copy waits)."""
    if numbers.device.type == "cpu":
        return numbers, None
    if numbers.device.type != "cuda":
        return numbers.cpu(), None
    host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
    host.copy_(numbers, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


__all__ = ["InFlight", "Launched", "NonFiniteError", "Stepper"]
