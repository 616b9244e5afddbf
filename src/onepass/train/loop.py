"""Fine-tune a HF causal LM on one-pass rows: an accelerate loop whose steps equal N-pass steps.

Why this module exists: a run is more than its steps. Each optimizer step
equals the N-pass step (:mod:`onepass.train.step` says why); around the steps
this module loads the data and the model, resumes from a checkpoint, evaluates
(:mod:`onepass.train.evaluation`) and saves on schedule, reports
(:mod:`onepass.train.report`), and stops so that the run can go on: Ctrl-C or
SIGTERM saves a checkpoint to resume from, a non-finite step stops before its
update with the last good step saved.

A plain loop over :class:`accelerate.Accelerator` rather than a Trainer
subclass: the step is a set of conversations whose row count varies by
schedule, which a Trainer's row-based sampler and loss scaling would fight.
accelerate still gives DDP / FSDP from ``accelerate launch`` (and torchrun),
bf16 autocast and the device; everything else (accumulation and
normalisation in the step, checkpoints, resume here) is in plain sight.

    >>> from onepass.train.loop import train
    >>> from onepass.train.config import load_config
    >>> result = train(load_config("configs/tiny-cpu.yaml", {"max_steps": 5}))   # doctest: +SKIP
    >>> result.losses[-1] < result.losses[0]                                      # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onepass.couplings import check_row_mask
from onepass.data.load import CONVERSATIONS, DataSource, resolve_data
from onepass.files import atomic_dir, check_writable, output_lock, write_failure
from onepass.private_names import private
from onepass.errors import OnePassError
from onepass.row_check import check_ids
from onepass.train import distributed
from onepass.train.checkpoint import (
    CheckpointWriteError,
    check_compatible,
    check_new_run,
    check_resume_step,
    check_resumed_run,
    clean_leftovers,
    find_checkpoint,
    is_sharded,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from onepass.train.cli import overrides_from_args, setup_logging
from onepass.train.config import TrainConfig, TrainConfigError, load_config, write_yaml
from onepass.train.data import (
    TrainData,
    check_same_units,
    compact_vocab,
    load_train_data,
    rows_setting,
    total_steps,
    units_digest,
)
from onepass.train.distributed import describe, shutdown
from onepass.train.evaluation import evaluate
from onepass.train.fingerprint import check_fingerprint, run_fingerprint
from onepass.train.model import (
    load_tokenizer_for,
    check_environment,
    check_exactness,
    check_sequence_parallel,
    count_parameters,
    load_model,
    make_optimizer,
    make_scheduler,
    resolve_attention,
    resolve_device,
    save_final,
)
from onepass.train.report import Reporter, make_trackers
from onepass.train.sequence_parallel import data_parallel, sequence_mesh, sequence_parallel_size
from onepass.train.step import NonFiniteError, Stepper, deliver


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
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # a second train() in one process may change precision
        private("accelerate.state.AcceleratorState._reset_state")(True)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
    tracking = dict(log_with=list(log_with), project_dir=str(config.output_dir)) if log_with else {}
    return distributed.make_accelerator(cpu=device.type == "cpu", mixed_precision=config.mixed_precision,
                                        **tracking)


@dataclass(frozen=True, kw_only=True)
class _Loaded:
    data: TrainData
    eval_data: TrainData | None
    tokenizer: Any | None
    used_ids: np.ndarray | None  # original ids of a compacted vocabulary
    vocab_size: int | None  # for a tiny model


def _load_data(config: TrainConfig, sources: Sequence[DataSource | None], *, main: bool,
               say: Callable[[str], None]) -> _Loaded:
    """Train (and eval) units of the run's resolved ``sources``; a tiny model's vocabulary is compacted to
    the ids that occur."""
    source, eval_source = sources
    assert source is not None
    raw = [s for s in sources if s is not None and s.kind == CONVERSATIONS]
    tokenizer = load_tokenizer_for(config) if config.model is not None or raw else None
    data = load_train_data(source, config, tokenizer, progress=config.progress and main, log=say)
    eval_data = load_train_data(eval_source, config, tokenizer, log=say) if eval_source is not None else None
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


def _most_rows(config: TrainConfig, data: TrainData) -> int:
    """The most rows one forward can batch (:func:`onepass.train.data.forward_groups`): a micro-batch's trees,
    at most ``max_batch_tokens // shortest row`` of them under a token budget."""
    rows = config.per_device_train_batch_size * max((len(unit) for unit in data.units), default=1)
    if config.max_batch_tokens:
        shortest = min((len(x) for unit in data.units for x in unit), default=1)
        rows = min(rows, max(1, config.max_batch_tokens // max(1, shortest)))
    return rows


def _check_ids(model: Any, *datas: TrainData | None) -> None:
    """Prepared rows hold only ids the model embeds (else a raw ``IndexError`` deep in the forward)."""
    vocab = model.get_input_embeddings().num_embeddings
    for d in datas:
        if d is not None and d.kind == "row":
            check_ids([x for u in d.units for x in u], vocab, source=f"prepared dataset {d.source}")


def _save_final(model: Any, loaded: _Loaded, path: Path, *, step: int, state_dict: Any) -> Path:
    """``save_final`` into ``path`` as a whole or not at all (a full disk leaves no half model folder)."""
    try:
        with atomic_dir(path) as tmp:
            save_final(model, loaded.tokenizer, tmp, used_ids=loaded.used_ids, state_dict=state_dict)
    except Exception as e:
        reason = write_failure(e)
        if reason is None:
            raise
        raise CheckpointWriteError(f"cannot write the final model to {path} ({reason}); the checkpoint of step {step} "
                                   "is complete: free space and --resume to write it") from None
    return path


def train(config: TrainConfig, *, resume: str | bool | None = None, log: Callable[[str], None] | None = None,
          resume_anyway: bool = False) -> TrainResult:
    """Run ``config``; with ``resume`` (True = latest checkpoint, or a checkpoint path) continue a run.

    Messages go to ``log`` (default: the ``onepass`` logger at INFO level). SIGTERM stops the run like
    Ctrl-C (a checkpoint to resume from, status "stopped"); a non-finite loss or gradient stops it with
    :class:`~onepass.train.step.NonFiniteError` before that step's update, keeping a checkpoint of the last
    good step.
    ``resume_anyway``: resume although settings, data or tokenizer differ from the checkpoint's."""
    steps = train_steps(config, resume=resume, log=log, resume_anyway=resume_anyway)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
            if steps.gi_frame is None:  # raised inside the run: it has already stopped (checkpoint, status)
                raise
            steps.throw(e)  # landed here, between two steps: the run stops as if inside one


def train_steps(config: TrainConfig, *, resume: str | bool | None = None, log: Callable[[str], None] | None = None,
                resume_anyway: bool = False) -> Generator[dict[str, Any], None, TrainResult]:
    """:func:`train`, one optimizer step per ``next()``: yields each step's record, returns the
    :class:`TrainResult`. Two runs advanced in turn time their steps under the same load (``make demo``
    interleaves one-pass and N-pass this way: :mod:`onepass.demo`). Run it to the end: a generator
    closed early closes its reporter and saves nothing. The output folder is locked while it runs."""
    main = int(os.environ.get("RANK", "0")) == 0  # one lock per run, held by its first process
    with _sigterm_as_interrupt(), output_lock(config.output_dir, command="train") if main else contextlib.nullcontext():
        return (yield from _train(config, resume=resume, log=log, resume_anyway=resume_anyway))


def _train(config: TrainConfig, *, resume: str | bool | None, log: Callable[[str], None] | None,
           resume_anyway: bool) -> Generator[dict[str, Any], None, TrainResult]:
    device = resolve_device(config.device)  # everything that can fail on this machine fails here, in a second
    check_environment(config, device)
    config = config.replace(sp_size=sequence_parallel_size(config.sp_size))  # the degree in effect, saved
    attention = resolve_attention(config.attention, device)
    sources = [resolve_data(s) if s is not None else None for s in (config.data, config.eval_data)]  # once per run
    out = Path(config.output_dir)
    log = log or logging.getLogger("onepass").info
    first = int(os.environ.get("RANK", "0")) == 0
    if first:  # a read-only folder is one line now, not a traceback once the data and the model are loaded
        check_writable(out)
        for line in clean_leftovers(out):  # locked (train_steps): what a killed save or pruning left
            log(line)
    ckpt = find_checkpoint(out, resume) if resume else None
    replaced = [] if resume else check_new_run(out, overwrite=config.overwrite_output_dir)  # never mix two runs
    saved = read_state(ckpt) if ckpt is not None else None
    if saved is not None:
        check_compatible(saved["config"], config, ckpt, anyway=resume_anyway, say=log)
    run_id = saved.get("run_id") if saved is not None else uuid.uuid4().hex[:12]  # pruning: this run's

    initial = saved["step"] if saved is not None else 0
    accelerator = make_accelerator(config, device, make_trackers(config.report_to, out, initial=initial))
    device, world, main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
    say: Callable[[str], None] = log if main else (lambda _msg: None)
    shard = sequence_mesh(accelerator, config.sp_size)  # None unless sp_size > 1
    if saved is not None:
        check_resumed_run(saved, ckpt, world=world, anyway=resume_anyway, say=say)
    parallel = describe(accelerator, sp_size=config.sp_size)
    say(parallel.line())  # the first line: what runs, not what was asked for
    loaded = _load_data(config, sources, main=main, say=say)  # each conversation read and rendered once
    # every process: a refusal stops all; on the conversations as loaded (their rendering, not a second one)
    exactness = check_exactness(config, loaded.data, loaded.tokenizer, attention=attention, log=say)
    split = check_sequence_parallel(config, attention=attention, log=say) if shard is not None else None
    if main:
        if out / "checkpoints" in replaced:
            shutil.rmtree(out / "checkpoints")
            say(f"--overwrite: removed the checkpoints of the earlier run in {out}")
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(config, out / "train_config.yaml")
    data, eval_data = loaded.data, loaded.eval_data
    rows = {"rows": units_digest(data), "eval_rows": units_digest(eval_data) if eval_data is not None else None}
    check_same_units(accelerator, config, data, rows)  # before the first collective whose count depends on it
    fingerprint = {**run_fingerprint(config, *sources, loaded.tokenizer, renders=any(
        d is not None and d.kind == "conversation" for d in (data, eval_data))), **rows}
    if saved is not None:
        check_fingerprint(saved.get("fingerprint"), fingerprint, ckpt, anyway=resume_anyway, say=say)
    total = total_steps(config, data.num_units, data_parallel(accelerator, shard)[0])
    if saved is not None:
        check_resume_step(saved, ckpt, total=total)
    model = load_model(config, device=device, attention=attention, vocab_size=loaded.vocab_size)
    check_row_mask(model, _most_rows(config, data))  # one line now, not a traceback inside the model
    _check_ids(model, data, eval_data)
    trainable, params = count_parameters(model)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, total)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = Stepper(accelerator, model, optimizer, scheduler, data, config, shard=shard)

    start, history, evals = 0, [], []
    if ckpt is not None:
        state = load_checkpoint(accelerator, model, optimizer, scheduler, ckpt)
        start, history, evals = state["step"], state["history"], state.get("evals", [])
        say(f"resumed from {ckpt} at step {start}")
    stats = data.stats
    schedule = rows_setting(config, data, "schedule", say)
    rows_setting(config, data, "weighting", say)
    header = {"config": config.to_dict(), "distributed": parallel.to_dict(), "world_size": world,
              "device": str(device), "attention": attention,
              "dtype": config.dtype, "mixed_precision": config.mixed_precision, "schedule": schedule,
              "parameters": params, "trainable_parameters": trainable, "units": data.num_units,
              "unit": data.kind, "units_per_step": stepper.per_step, "total_steps": total,
              "data_stats": {k: v for k, v in stats.items() if k != "skipped"}, "vocab_size": loaded.vocab_size,
              "exactness": exactness, "sequence_parallel": split}
    say(f"training {config.model or f'tiny {config.tiny} (random)'}: {params:,} parameters, {trainable:,} "
        f"trainable ({config.finetune}), {config.dtype}, attention {attention}, {device}, {world} process(es)")
    say(f"data {config.data}: {data.num_units} {data.kind}s, {stepper.per_step} per step, {total} steps; "
        f"schedule {schedule}" + (f", {stats.get('n_pass_tokens', 0):,} N-pass tokens -> "
                                         f"{stats.get('scheduled_tokens', 0):,} in trees"
                                         if data.kind == "conversation" else ""))
    reporter = Reporter(out, main=main, progress=config.progress, total=total, initial=start, header=header,
                        history=history, evals=evals, log=say, accelerator=accelerator, run_name=config.run_name)

    def save(at: int, *, plot: bool = True) -> None:
        reporter.flush()  # the log holds every step up to the checkpoint
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
            deliver(stepper.held)  # a stop that arrived during the update stops the run now that the step counts
            yield record
            if eval_data is not None and config.eval_steps and step % config.eval_steps == 0 and step < total:
                reporter.log_eval(step, evaluate(accelerator, model, eval_data, config, shard))
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
            try:
                save(step)
            except OnePassError as unsaved:  # weights not finite, a full disk: said; the stop stays the error
                say(f"no checkpoint of step {step}: {unsaved}")
        raise
    reporter.write_summary(status="finishing")  # "finished" is written last, once the final save is done
    try:
        try:  # the final eval reaches the trackers: they close after it
            final_eval = evaluate(accelerator, model, eval_data, config, shard) if eval_data is not None else None
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
                final_dir = _save_final(accelerator.unwrap_model(model), loaded, out / "final", step=step,
                                        state_dict=state_dict)
                say(f"saved the {'adapter' if config.finetune != 'full' else 'model'} to {final_dir}")
            accelerator.wait_for_everyone()
    except BaseException as e:  # never left "finishing": the trained steps are counted, the end did not happen
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        reporter.write(status=f"stopped at step {step} while finishing ({reason})")
        raise
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


def run(args: argparse.Namespace) -> int:
    """``onepass train`` (flags: :mod:`onepass.train.cli`): 0 when the run finished. Bad settings raise a
    OnePassError (one line)."""
    setup_logging()
    config = load_config(args.config, overrides_from_args(args))
    train(config, resume=args.resume, resume_anyway=args.resume_anyway)
    shutdown()  # after a finished run only: a rank that failed must not wait in a collective for the others
    return 0


__all__ = ["TrainResult", "run", "train", "train_steps"]
