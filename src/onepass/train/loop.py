"""Fine-tune a HF causal LM on one-pass rows: an accelerate loop whose steps equal N-pass steps.

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
and 2 processes equal 1 process on the same global batch.

A plain loop over :class:`accelerate.Accelerator` rather than a Trainer
subclass: the step is a set of conversations whose row count varies by
schedule, which a Trainer's row-based sampler and loss scaling would fight.
accelerate still gives DDP / FSDP from ``accelerate launch`` (and torchrun),
bf16 autocast and the device; everything else (accumulation, normalisation,
checkpoints, resume) is here in plain sight.

    >>> from onepass.train.loop import train
    >>> from onepass.train.config import load_config
    >>> result = train(load_config("configs/tiny-cpu.yaml", {"max_steps": 5}))   # doctest: +SKIP
    >>> result.losses[-1] < result.losses[0]                                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onepass.errors import OnePassError
from onepass.flops import visible_pairs
from onepass.loss import ForwardView, batch_loss
from onepass.train.config import TrainConfig, TrainConfigError, write_yaml
from onepass.train.fingerprint import check_fingerprint, run_fingerprint
from onepass.train.data import (
    TrainData,
    check_data,
    collate,
    compact_vocab,
    empty_row,
    forward_groups,
    load_train_data,
    micro_batch_rows,
    rank_slots,
    step_units,
    total_steps,
    units_per_step,
)
from onepass.tree import Layout


class NonFiniteError(OnePassError):
    """A step whose loss or gradient is NaN or infinite: training stops before it changes the weights."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and systemd send before they kill): handled like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises :class:`Terminated` in the main thread while training, so a scheduler's stop writes a
    checkpoint and status "stopped" like Ctrl-C does; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise Terminated(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float]  # one per optimizer step, this run's and resumed ones
    eval_loss: float | None
    final_dir: Path | None
    metrics_path: Path
    plot_path: Path | None
    seconds: float  # wall time of the optimizer steps run by this call
    tokens: int  # real (unpadded) row tokens processed by this call, all processes


def make_accelerator(config: TrainConfig, device: torch.device, log_with: Sequence[Any] = ()) -> Any:
    """The run's ``Accelerator``; ``log_with``: its trackers (:func:`onepass.train.report.make_trackers`)."""
    from accelerate.state import AcceleratorState

    from onepass.train import distributed

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        AcceleratorState._reset_state(True)  # a second train() in one process may change precision
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
    tracking = dict(log_with=list(log_with), project_dir=str(config.output_dir)) if log_with else {}
    return distributed.make_accelerator(cpu=device.type == "cpu", mixed_precision=config.mixed_precision,
                                        **tracking)


def _rank_passes(data: TrainData, units: Sequence[int], config: TrainConfig, *, rank: int, world: int
                 ) -> list[list[Layout]]:
    """Forward passes (lists of rows) of ``rank`` for the step holding ``units``."""
    passes: list[list[Layout]] = []
    for slot in rank_slots(units, rank=rank, world=world, batch_size=config.per_device_train_batch_size,
                           grad_accum=config.gradient_accumulation_steps):
        rows = micro_batch_rows(data, slot, pack=config.data_config.pack, max_tokens=config.data_config.max_tokens)
        passes.extend(forward_groups(rows, config.max_batch_tokens))
    return passes


def _micro_passes(data: TrainData, units: Sequence[int], config: TrainConfig, *, rank: int, world: int,
                  even: bool = False) -> tuple[list[list[Layout]], int]:
    """This rank's forward passes for one step, and how many of them hold data (they come first).

    A rank without data (the last step of an epoch) runs one zero-weight row, so every
    process joins the gradient all-reduce. ``even`` (FSDP / DeepSpeed, which gather
    parameters in every forward): every rank runs as many passes as the busiest one.
    """
    passes = _rank_passes(data, units, config, rank=rank, world=world)
    most = max(len(_rank_passes(data, units, config, rank=r, world=world)) for r in range(world)) if even else 1
    return passes + [[empty_row()] for _ in range(most - len(passes))], len(passes)


def evaluate(accelerator: Any, model: Any, data: TrainData, config: TrainConfig) -> float:
    """Weighted mean loss of ``data``: every process takes every world-th unit; sums are reduced.

    Under DDP the unwrapped module runs (a DDP forward may broadcast buffers, a collective
    that processes with different numbers of passes would not match); sharded models run
    wrapped, with every process padded to the same number of passes.
    """
    from onepass.train.checkpoint import is_sharded

    world, rank, sharded = accelerator.num_processes, accelerator.process_index, is_sharded(accelerator)
    unwrapped = accelerator.unwrap_model(model)
    view = ForwardView(model if sharded else unwrapped, unwrapped)

    def passes(r: int) -> list[list[Layout]]:
        mine = list(range(r, data.num_units, world))
        out: list[list[Layout]] = []
        for start in range(0, len(mine), config.per_device_train_batch_size):
            rows = micro_batch_rows(data, mine[start:start + config.per_device_train_batch_size],
                                    pack=config.data_config.pack,
                                    max_tokens=config.data_config.max_tokens)
            out.extend(forward_groups(rows, config.max_batch_tokens))
        return out

    todo = passes(rank)
    if sharded:
        todo += [[empty_row()]] * (max(len(passes(r)) for r in range(world)) - len(todo))
    was_training = unwrapped.training
    unwrapped.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for group in todo:
            batch = collate(group, accelerator.device)
            total[0] += batch_loss(view, batch).double()
            total[1] += batch["weights"].sum()
    total = accelerator.reduce(total, reduction="sum")
    unwrapped.train(was_training)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def eval_loss(model: Any, rows: Sequence[Layout], *, batch_size: int = 1) -> float:
    """Weighted mean loss of ``rows`` for any HF causal LM (or peft model), one process, no grad."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    num, den = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size], device)
            num += float(batch_loss(model, batch))
            den += float(batch["weights"].sum())
    model.train(was_training)
    return num / den


@dataclass(frozen=True, kw_only=True)
class _Loaded:
    data: TrainData
    eval_data: TrainData | None
    tokenizer: Any | None
    used_ids: np.ndarray | None  # original ids of a compacted vocabulary
    vocab_size: int | None  # for a tiny model


def _load_data(config: TrainConfig, *, main: bool, say: Callable[[str], None]) -> _Loaded:
    """Train (and eval) units; a tiny model's vocabulary is compacted to the ids that occur."""
    from onepass.train.model import load_tokenizer_for

    raw = [s for s in (config.data, config.eval_data) if s is not None and check_data(s).kind == "conversations"]
    tokenizer = load_tokenizer_for(config) if config.model is not None or raw else None
    data = load_train_data(config.data, config, tokenizer, progress=config.progress and main, log=say)
    eval_data = (load_train_data(config.eval_data, config, tokenizer, log=say)
                 if config.eval_data is not None else None)
    used_ids, vocab_size = None, None
    if config.tiny is not None and config.compact_vocab:
        compacted, used_ids = compact_vocab(*[d for d in (data, eval_data) if d is not None])
        data, eval_data = compacted[0], (compacted[1] if eval_data is not None else None)
        vocab_size = len(used_ids)
    elif config.tiny is not None:
        vocab_size = len(tokenizer) if tokenizer is not None else 1 + max(
            int(x.input_ids.max()) for u in data.units for x in u)
        if vocab_size > _MAX_VOCAB:  # one stray id would size the embedding (1e9 ids: a 1.3B model)
            raise TrainConfigError(f"{config.data} holds token id {vocab_size - 1:,}, more than any tokenizer has "
                                   f"({_MAX_VOCAB:,}); keep compact_vocab on or prepare the data again")
    return _Loaded(data=data, eval_data=eval_data, tokenizer=tokenizer, used_ids=used_ids, vocab_size=vocab_size)


_MAX_VOCAB = 1 << 21  # more ids than any released tokenizer has (the largest are ~260k)


def _check_ids(model: Any, *datas: TrainData | None) -> None:
    """Prepared rows hold only ids the model embeds (else a raw ``IndexError`` deep in the forward)."""
    from onepass.row_check import check_ids

    vocab = model.get_input_embeddings().num_embeddings
    for d in datas:
        if d is not None and d.kind == "row":
            check_ids([x for u in d.units for x in u], vocab, source=f"prepared dataset {d.source}")


class _Stepper:
    """One optimizer step: this process's passes, scaled backward, clip, update, reduced metrics."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, data: TrainData,
                 config: TrainConfig) -> None:
        from onepass.train.checkpoint import is_sharded

        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.data, self.config = data, config
        self.view = ForwardView(model, accelerator.unwrap_model(model))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.per_step = units_per_step(config, self.world)
        self.even = is_sharded(accelerator)
        self.updating = False  # True inside the parameter update: no checkpoint may be taken then

    def __call__(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based); returns its record (``step`` in the record counts from 1)."""
        acc, config, data, device = self.accelerator, self.config, self.data, self.accelerator.device
        t0 = time.perf_counter()
        units = step_units(data.num_units, step, seed=config.seed, per_step=self.per_step)
        weight = data.weight_sum(units)  # the same on every process: all hold the whole unit list
        scale = self.world / weight if weight > 0 else 0.0
        passes, num_real = _micro_passes(data, units, config, rank=self.rank, world=self.world, even=self.even)
        # loss sum, tokens, padded tokens, attention pairs a dense kernel computes, visible pairs
        sums = torch.zeros(5, dtype=torch.float64, device=device)
        for i, rows in enumerate(passes):
            batch = collate(rows, device)
            with acc.no_sync(self.model) if i < len(passes) - 1 else contextlib.nullcontext():
                loss_sum = batch_loss(self.view, batch)
                acc.backward(loss_sum * scale)
            sums[0] += loss_sum.detach().double()
            if i < num_real:
                B, L = batch["input_ids"].shape
                sums[1:] += torch.tensor([sum(len(r) for r in rows), B * L, B * L * L,
                                          sum(visible_pairs(r) for r in rows)], dtype=torch.float64, device=device)
        self.updating = True
        grad_norm = acc.clip_grad_norm_(self.params, config.max_grad_norm or float("inf"))
        if not (math.isfinite(float(grad_norm)) and math.isfinite(float(sums[0]))):
            self.optimizer.zero_grad(set_to_none=True)  # the weights are still those of the last good step
            self.updating = False
            raise NonFiniteError(f"step {step + 1}: the loss is {float(sums[0])} and the gradient norm "
                                 f"{float(grad_norm)}; the run stops before the update (a checkpoint keeps the "
                                 "last good step): lower the learning rate or check the data and dtype")
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


def train(config: TrainConfig, *, resume: str | bool | None = None, log: Callable[[str], None] | None = None,
          resume_anyway: bool = False) -> TrainResult:
    """Run ``config``; with ``resume`` (True = latest checkpoint, or a checkpoint path) continue a run.

    Messages go to ``log`` (default: the ``onepass`` logger at INFO level). SIGTERM stops the run like
    Ctrl-C (a checkpoint to resume from, status "stopped"); a non-finite loss or gradient stops it with
    :class:`NonFiniteError` before that step's update, keeping a checkpoint of the last good step.
    ``resume_anyway``: resume although settings, data or tokenizer differ from the checkpoint's."""
    steps = train_steps(config, resume=resume, log=log, resume_anyway=resume_anyway)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def train_steps(config: TrainConfig, *, resume: str | bool | None = None, log: Callable[[str], None] | None = None,
                resume_anyway: bool = False) -> Generator[dict[str, Any], None, TrainResult]:
    """:func:`train`, one optimizer step per ``next()``: yields each step's record, returns the
    :class:`TrainResult`. Two runs advanced in turn time their steps under the same load (``make demo``
    interleaves one-pass and N-pass this way: :mod:`onepass.demo`). Run it to the end: a generator
    closed early closes its reporter and saves nothing. The output folder is locked while it runs."""
    from onepass.files import output_lock

    main = int(os.environ.get("RANK", "0")) == 0  # one lock per run, held by its first process
    with _sigterm_as_interrupt(), output_lock(config.output_dir, command="train") if main else contextlib.nullcontext():
        return (yield from _train(config, resume=resume, log=log, resume_anyway=resume_anyway))


def _train(config: TrainConfig, *, resume: str | bool | None, log: Callable[[str], None] | None,
           resume_anyway: bool) -> Generator[dict[str, Any], None, TrainResult]:
    from onepass.train.checkpoint import (
        check_compatible,
        check_new_run,
        find_checkpoint,
        is_sharded,
        load_checkpoint,
        read_state,
        save_checkpoint,
    )
    from onepass.train.model import (
        check_environment,
        check_exactness,
        count_parameters,
        load_model,
        make_optimizer,
        make_scheduler,
        resolve_attention,
        resolve_device,
        save_final,
    )
    from onepass.train.distributed import describe
    from onepass.train.report import Reporter, make_trackers

    device = resolve_device(config.device)  # everything that can fail on this machine fails here, in a second
    check_environment(config, device)
    attention = resolve_attention(config.attention, device)
    for spec in (config.data, config.eval_data):
        if spec is not None:
            check_data(spec)
    out = Path(config.output_dir)
    ckpt = find_checkpoint(out, resume) if resume else None
    replaced = [] if resume else check_new_run(out, overwrite=config.overwrite_output_dir)  # never mix two runs
    if ckpt is not None:
        check_compatible(read_state(ckpt)["config"], config, ckpt, anyway=resume_anyway, say=log)
    run_id = read_state(ckpt).get("run_id") if ckpt is not None else uuid.uuid4().hex[:12]  # pruning: this run's

    log = log or logging.getLogger("onepass").info
    initial = read_state(ckpt)["step"] if ckpt is not None else 0
    accelerator = make_accelerator(config, device, make_trackers(config.report_to, out, initial=initial))
    device, world, main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
    say: Callable[[str], None] = log if main else (lambda _msg: None)
    parallel = describe(accelerator)
    say(parallel.line())  # the first line: what runs, not what was asked for
    exactness = check_exactness(config, attention=attention, log=say)  # every process: a refusal stops all
    if main:
        if out / "checkpoints" in replaced:
            shutil.rmtree(out / "checkpoints")
            say(f"--overwrite: removed the checkpoints of the earlier run in {out}")
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(config, out / "train_config.yaml")
    loaded = _load_data(config, main=main, say=say)
    fingerprint = run_fingerprint(config, loaded.tokenizer)
    if ckpt is not None:
        check_fingerprint(read_state(ckpt).get("fingerprint"), fingerprint, ckpt, anyway=resume_anyway, say=say)
    data, eval_data = loaded.data, loaded.eval_data
    total = total_steps(config, data.num_units, world)
    model = load_model(config, device=device, attention=attention, vocab_size=loaded.vocab_size)
    _check_ids(model, data, eval_data)
    trainable, params = count_parameters(model)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, total)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = _Stepper(accelerator, model, optimizer, scheduler, data, config)

    start, history, evals = 0, [], []
    if ckpt is not None:
        state = load_checkpoint(accelerator, model, optimizer, scheduler, ckpt)
        start, history, evals = state["step"], state["history"], state.get("evals", [])
        say(f"resumed from {ckpt} at step {start}")
    stats = data.stats
    header = {"config": config.to_dict(), "distributed": parallel.to_dict(), "world_size": world, "device": str(device), "attention": attention,
              "dtype": config.dtype, "mixed_precision": config.mixed_precision, "schedule": config.data_config.schedule,
              "parameters": params, "trainable_parameters": trainable, "units": data.num_units,
              "unit": data.kind, "units_per_step": stepper.per_step, "total_steps": total,
              "data_stats": {k: v for k, v in stats.items() if k != "skipped"}, "vocab_size": loaded.vocab_size,
              "exactness": exactness}
    say(f"training {config.model or f'tiny {config.tiny} (random)'}: {params:,} parameters, {trainable:,} "
        f"trainable ({config.finetune}), {config.dtype}, attention {attention}, {device}, {world} process(es)")
    say(f"data {config.data}: {data.num_units} {data.kind}s, {stepper.per_step} per step, {total} steps; "
        f"schedule {config.data_config.schedule}" + (f", {stats.get('n_pass_tokens', 0):,} N-pass tokens -> "
                                         f"{stats.get('scheduled_tokens', 0):,} in trees"
                                         if data.kind == "conversation" else ""))
    reporter = Reporter(out, main=main, progress=config.progress, total=total, initial=start, header=header,
                        history=history, evals=evals, log=say, accelerator=accelerator, run_name=config.run_name)

    def save(at: int, *, plot: bool = True) -> None:
        state = {"config": config.to_dict(), "history": reporter.history, "evals": reporter.evals,
                 "world_size": world, "total_steps": total, "run_id": run_id, "fingerprint": fingerprint}
        path = save_checkpoint(accelerator, model, optimizer, scheduler, output_dir=out, step=at, state=state,
                               keep=config.save_total_limit)
        if plot:
            reporter.plot()
        if reporter.bar is None:
            say(f"saved checkpoint {path}")

    step, run_tokens, run_seconds = start, 0, 0.0
    try:
        model.train()
        while step < total:
            record = stepper(step)
            step += 1
            run_seconds += record["seconds"]
            run_tokens += record["tokens"]
            reporter.log_step(record, write=step % config.logging_steps == 0 or step == total)
            yield record
            if eval_data is not None and config.eval_steps and step % config.eval_steps == 0 and step < total:
                reporter.log_eval(step, evaluate(accelerator, model, eval_data, config))
            if config.save_steps and step % config.save_steps == 0 and step < total:
                save(step)
    except GeneratorExit:  # train_steps abandoned by its caller: not an interruption to checkpoint
        reporter.close()
        raise
    except BaseException as e:  # Ctrl-C, SIGTERM or an error between updates: keep what was trained (one process)
        reporter.close()
        reporter.write(status=f"stopped at step {step}" + (" (non-finite loss)" if isinstance(e, NonFiniteError)
                                                           else ""))
        if world == 1 and not stepper.updating and step > start:
            say(f"interrupted after step {step}: saving a checkpoint to resume from")
            save(step)
        raise
    reporter.write(status="finishing")  # "finished" is written last, once the final save is done
    try:  # the final eval reaches the trackers: they close after it
        final_eval = evaluate(accelerator, model, eval_data, config) if eval_data is not None else None
        if final_eval is not None:
            reporter.log_eval(step, final_eval)
    finally:
        reporter.close()
    if start < total or ckpt is None:
        save(step, plot=False)
    final_dir = None
    if config.save_model:
        state_dict = accelerator.get_state_dict(model) if is_sharded(accelerator) else None
        if main:
            final_dir = save_final(accelerator.unwrap_model(model), loaded.tokenizer, out / "final",
                                   used_ids=loaded.used_ids, state_dict=state_dict)
            say(f"saved the {'adapter' if config.finetune != 'full' else 'model'} to {final_dir}")
        accelerator.wait_for_everyone()
    plot = reporter.plot()
    summary = {"status": "finished", "steps": step, "final_loss": reporter.history[-1]["loss"],
               "eval_loss": final_eval, "train_seconds": run_seconds, "train_tokens": run_tokens}
    reporter.write(**summary)
    say(f"done: {step} steps, final loss {summary['final_loss']:.4f}"
        + (f", eval loss {final_eval:.4f}" if final_eval is not None else "")
        + f"; metrics {reporter.metrics_path}" + (f", curve {plot}" if plot else ""))
    return TrainResult(output_dir=out, steps=step, losses=[r["loss"] for r in reporter.history],
                       eval_loss=final_eval, final_dir=final_dir, metrics_path=reporter.metrics_path,
                       plot_path=plot, seconds=run_seconds, tokens=run_tokens)


__all__ = ["NonFiniteError", "TrainConfig", "TrainConfigError", "TrainResult", "eval_loss", "evaluate", "train",
           "train_steps"]
