"""Fine-tune a HF causal LM on one-pass rows: an accelerate loop whose steps equal N-pass steps.

Why this module exists: a run is more than its steps. Each optimizer step
equals the N-pass step (:mod:`onepass.train.run.step` says why); around the steps
this module loads the data and the model, resumes from a checkpoint, evaluates
(:mod:`onepass.train.run.evaluation`) and saves on schedule, reports
(:mod:`onepass.train.core.report`), and stops so that the run can go on: Ctrl-C or
SIGTERM saves a checkpoint to resume from, a non-finite step stops before its
update with the last good step saved.

A plain loop over :class:`accelerate.Accelerator` rather than a Trainer
subclass: the step is a set of conversations whose row count varies by
schedule, which a Trainer's row-based sampler and loss scaling would fight.
accelerate still gives DDP / FSDP from ``accelerate launch`` (and torchrun),
bf16 autocast and the device; everything else (accumulation and
normalisation in the step, checkpoints, resume here) is in plain sight.

    >>> from onepass.train.run.loop import train
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
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onepass.data.sources import CONVERSATIONS, DataSource, resolve_data
from onepass.files import atomic_dir, check_writable, output_lock, write_failure
from onepass.model.private_names import private
from onepass.errors import OnePassError
from onepass.layout.row_check import check_ids, model_vocab
from onepass.train import distributed
from onepass.train.run.compiles import run_shapes
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
from onepass.train.run.data import (
    TrainData,
    batch_cap_note,
    check_same_units,
    compact_vocab,
    load_train_data,
    rows_setting,
    total_steps,
    units_digest,
)
from onepass.train.distributed import describe, shutdown
from onepass.train.run.evaluation import evaluate
from onepass.train.fingerprint import check_fingerprint, run_fingerprint
from onepass.train.run.model import (
    load_tokenizer_for,
    check_environment,
    check_exactness,
    count_parameters,
    load_model,
    resolve_attention,
    model_config_of,
    resolve_device,
    save_final,
)
from onepass.train.run.optimizer import make_optimizer, make_scheduler
from onepass.train.core.report import Reporter, make_trackers
from onepass.train.sequence_parallel import ParallelDims, check_split, parallel_dims, sequence_parallel_size
from onepass.train.run.signals import deliver, sigterm_as_interrupt
from onepass.train.run.step import InFlight, NonFiniteError, Stepper


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
    """The run's ``Accelerator``; ``log_with``: its trackers (:func:`onepass.train.core.report.make_trackers`)."""
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
    packed_to = config.data_config.max_tokens if config.data_config.pack and data.kind == "conversation" else None
    cap = batch_cap_note(config.max_batch_tokens, data.units, packed_to=packed_to)
    if cap is not None:
        say(f"note: {cap}")
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
    vocab = model_vocab(model)  # the bound OnePassTrainer checks its rows against
    assert vocab is not None, "a model onepass train loaded has an input embedding"
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
    :class:`~onepass.train.run.step.NonFiniteError` before that step's update, keeping a checkpoint of the last
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
    with sigterm_as_interrupt(), output_lock(config.output_dir, command="train") if main else contextlib.nullcontext():
        return (yield from _train(config, resume=resume, log=log, resume_anyway=resume_anyway))


def _train(config: TrainConfig, *, resume: str | bool | None, log: Callable[[str], None] | None,
           resume_anyway: bool) -> Generator[dict[str, Any], None, TrainResult]:
    """A run as its steps, in order, each a function below: the machine checked, the output folder opened, the
    processes started, the data loaded (once) and the exactness guard run, the run folder written, the rows
    checked, the model built, a checkpoint resumed, the report started; then the optimizer steps (each
    yielded), the end (final eval, checkpoint, model) and the summary."""
    config, device, attention = _check_machine(config)  # everything that can fail on this machine fails here
    sources = [resolve_data(s, trl_records=True) if s is not None else None  # once per run; TRL's types too
               for s in (config.data, config.eval_data)]
    log = log or logging.getLogger("onepass").info
    prior = _open_output(config, resume, anyway=resume_anyway, log=log)
    procs = _start_processes(config, device, prior, anyway=resume_anyway, log=log)
    loaded = _load_data(config, sources, main=procs.main, say=procs.say)  # each conversation read and rendered once
    exactness, split = _check_exact(config, loaded, attention, procs)
    _write_run_folder(config, prior, procs)
    fingerprint, total = _check_rows(config, sources, loaded, prior, procs, anyway=resume_anyway)
    parts = _build_model(config, loaded, attention, total, procs)
    start, history, evals = _resume(prior, parts, procs)
    reporter = _start_report(config, prior, loaded, parts, procs, attention=attention, total=total,
                             resumed=(start, history, evals), guard=(exactness, split))
    run = _Run(config=config, prior=prior, procs=procs, loaded=loaded, parts=parts, fingerprint=fingerprint,
               total=total, start=start, reporter=reporter)
    step, seconds, tokens = yield from _step_loop(run)
    final_eval, final_dir = _finish(run, step)
    return _done(run, step, final_eval=final_eval, final_dir=final_dir, seconds=seconds, tokens=tokens)


def _check_machine(config: TrainConfig) -> tuple[TrainConfig, torch.device, str]:
    """The device, the environment (packages, GPU features the settings need) and the attention backend,
    checked in a second before anything is loaded; ``config`` with the sequence-parallel degree in effect."""
    device = resolve_device(config.device)
    check_environment(config, device)
    config = config.replace(sp_size=sequence_parallel_size(config.sp_size))  # the degree in effect, saved
    return config, device, resolve_attention(config.attention, device)


@dataclass(frozen=True, kw_only=True)
class _Prior:
    """The output folder as the run found it: the checkpoint it resumes and that checkpoint's saved state, or
    what of an earlier run a new run replaces; the run's id (pruning removes only its own checkpoints)."""
    out: Path
    ckpt: Path | None
    saved: dict[str, Any] | None
    replaced: list[Path]
    run_id: str


def _open_output(config: TrainConfig, resume: str | bool | None, *, anyway: bool,
                 log: Callable[[str], None]) -> _Prior:
    """The output folder checked before anything heavy: writable, what a killed save left cleaned (first
    process, under the lock of :func:`train_steps`), the checkpoint to resume found and its settings checked,
    or an earlier run refused unless ``overwrite_output_dir`` (never mix two runs)."""
    out = Path(config.output_dir)
    if int(os.environ.get("RANK", "0")) == 0:  # a read-only folder is one line now, not once the model is loaded
        check_writable(out)
        for line in clean_leftovers(out):  # what a killed save or pruning left
            log(line)
    ckpt = find_checkpoint(out, resume) if resume else None
    replaced = [] if resume else check_new_run(out, overwrite=config.overwrite_output_dir)  # never mix two runs
    saved = read_state(ckpt) if ckpt is not None else None
    if saved is not None:
        check_compatible(saved["config"], config, ckpt, anyway=anyway, say=log)
    run_id = saved.get("run_id") if saved is not None else uuid.uuid4().hex[:12]  # pruning: this run's
    return _Prior(out=out, ckpt=ckpt, saved=saved, replaced=replaced, run_id=run_id)


@dataclass(frozen=True, kw_only=True)
class _Processes:
    """The processes running the run, as accelerate started them; ``say`` logs on the main process only."""
    accelerator: Any
    device: torch.device
    world: int
    main: bool
    say: Callable[[str], None]
    dims: ParallelDims  # the parallel layout: data and sequence degrees, ranks, the mesh (built once)
    parallel: Any  # what runs (:func:`onepass.train.distributed.describe`)


def _start_processes(config: TrainConfig, device: torch.device, prior: _Prior, *, anyway: bool,
                     log: Callable[[str], None]) -> _Processes:
    """The accelerator (and its trackers) and the sequence-parallel mesh; a resumed run's process count checked;
    the first line logged says what runs, not what was asked for."""
    initial = prior.saved["step"] if prior.saved is not None else 0
    accelerator = make_accelerator(config, device, make_trackers(config.report_to, prior.out, initial=initial))
    device, world, main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
    say: Callable[[str], None] = log if main else (lambda _msg: None)
    dims = parallel_dims(accelerator, config.sp_size)  # the (dp, sp) mesh when sp_size > 1
    if prior.saved is not None:
        check_resumed_run(prior.saved, prior.ckpt, world=world, anyway=anyway, say=say)
    parallel = describe(accelerator, sp_size=dims.sp)
    say(parallel.line())  # the first line: what runs, not what was asked for
    return _Processes(accelerator=accelerator, device=device, world=world, main=main, say=say, dims=dims,
                      parallel=parallel)


def _check_exact(config: TrainConfig, loaded: _Loaded, attention: str, procs: _Processes) -> tuple[Any, Any]:
    """The exactness guard and the sequence-parallel split check, on every process (a refusal stops all), on
    the conversations as loaded (their rendering, not a second one): their results for the metrics header."""
    exactness = check_exactness(config, loaded.data, loaded.tokenizer, attention=attention, log=procs.say)
    split = (check_split(model_config_of(config), config.sp_size, backend=attention, log=procs.say)
             if procs.dims.sp > 1 else None)
    return exactness, split


def _write_run_folder(config: TrainConfig, prior: _Prior, procs: _Processes) -> None:
    """Main process: an overwritten run's checkpoints removed, the output folder made, ``train_config.yaml``."""
    if not procs.main:
        return
    out = prior.out
    if out / "checkpoints" in prior.replaced:
        shutil.rmtree(out / "checkpoints")
        procs.say(f"--overwrite: removed the checkpoints of the earlier run in {out}")
    out.mkdir(parents=True, exist_ok=True)
    write_yaml(config, out / "train_config.yaml")


def _check_rows(config: TrainConfig, sources: Sequence[DataSource | None], loaded: _Loaded, prior: _Prior,
                procs: _Processes, *, anyway: bool) -> tuple[dict[str, Any], int]:
    """The run's fingerprint (settings, data, tokenizer, rows) and its total steps: every process holds the
    same units; a resumed run's data and step checked against its checkpoint."""
    data, eval_data = loaded.data, loaded.eval_data
    rows = {"rows": units_digest(data), "eval_rows": units_digest(eval_data) if eval_data is not None else None}
    check_same_units(procs.accelerator, config, data, rows)  # before the first collective whose count depends on it
    fingerprint = {**run_fingerprint(config, *sources, loaded.tokenizer, renders=any(
        d is not None and d.kind == "conversation" for d in (data, eval_data))), **rows}
    if prior.saved is not None:
        check_fingerprint(prior.saved.get("fingerprint"), fingerprint, prior.ckpt, anyway=anyway, say=procs.say)
    total = total_steps(config, data.num_units, procs.dims.dp)
    if prior.saved is not None:
        check_resume_step(prior.saved, prior.ckpt, total=total)
    return fingerprint, total


@dataclass(frozen=True, kw_only=True)
class _Parts:
    """What trains: the model and its optimizer prepared by accelerate, the scheduler, the stepper."""
    model: Any
    optimizer: Any
    scheduler: Any
    stepper: Stepper
    params: int
    trainable: int


def _build_model(config: TrainConfig, loaded: _Loaded, attention: str, total: int, procs: _Processes) -> _Parts:
    """The model (the rows' ids checked against it), optimizer, scheduler and stepper."""
    data = loaded.data
    model = load_model(config, device=procs.device, attention=attention, vocab_size=loaded.vocab_size)
    _check_ids(model, data, loaded.eval_data)
    trainable, params = count_parameters(model)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, total)
    model, optimizer = procs.accelerator.prepare(model, optimizer)
    stepper = Stepper(procs.accelerator, model, optimizer, scheduler, data, config, dims=procs.dims)
    if attention in COMPILED_BACKENDS and config.length_buckets:  # a compile per shape: a few shapes
        world, rank = procs.dims.dp, procs.dims.dp_rank
        stepper.shapes = run_shapes(config, loaded.data, total, rank=rank, world=world, even=stepper.even,
                                    eval_data=loaded.eval_data, say=procs.say)
    return _Parts(model=model, optimizer=optimizer, scheduler=scheduler, stepper=stepper, params=params,
                  trainable=trainable)


COMPILED_BACKENDS = ("flex_attention",)  # attention that compiles per shape: its forwards run in length buckets


def _resume(prior: _Prior, parts: _Parts, procs: _Processes) -> tuple[int, list[Any], list[Any]]:
    """The step to start from and the history and evals so far: a checkpoint's (its weights, optimizer,
    scheduler and RNG states loaded), else a fresh start."""
    if prior.ckpt is None:
        return 0, [], []
    state = load_checkpoint(procs.accelerator, parts.model, parts.optimizer, parts.scheduler, prior.ckpt)
    procs.say(f"resumed from {prior.ckpt} at step {state['step']}")
    return state["step"], state["history"], state.get("evals", [])


def _start_report(config: TrainConfig, prior: _Prior, loaded: _Loaded, parts: _Parts, procs: _Processes, *,
                  attention: str, total: int, resumed: tuple[int, list[Any], list[Any]],
                  guard: tuple[Any, Any]) -> Reporter:
    """The run's :class:`~onepass.train.core.report.Reporter`, its metrics header saying what runs (settings,
    processes, model, data, the guard's results); the schedule and weighting in effect and two lines saying
    what trains on what are logged first."""
    (start, history, evals), (exactness, split) = resumed, guard
    data, stepper, device = loaded.data, parts.stepper, procs.device
    stats = data.stats
    schedule = rows_setting(config, data, "schedule", procs.say)
    rows_setting(config, data, "weighting", procs.say)
    header = {"config": config.to_dict(), "distributed": procs.parallel.to_dict(), "world_size": procs.world,
              "device": str(device), "attention": attention,
              "dtype": config.dtype, "mixed_precision": config.mixed_precision, "schedule": schedule,
              "parameters": parts.params, "trainable_parameters": parts.trainable, "units": data.num_units,
              "unit": data.kind, "units_per_step": stepper.per_step, "total_steps": total,
              "data_stats": {k: v for k, v in stats.items() if k != "skipped"}, "vocab_size": loaded.vocab_size,
              "exactness": exactness, "sequence_parallel": split,
              "length_buckets": list(stepper.shapes.buckets) if stepper.shapes is not None else None}
    procs.say(f"training {config.model or f'tiny {config.tiny} (random)'}: {parts.params:,} parameters, "
              f"{parts.trainable:,} trainable ({config.finetune}), {config.dtype}, attention {attention}, {device}, "
              f"{procs.world} process(es)")
    procs.say(f"data {config.data}: {data.num_units} {data.kind}s, {stepper.per_step} per step, {total} steps; "
              f"schedule {schedule}" + (f", {stats.get('n_pass_tokens', 0):,} N-pass tokens -> "
                                               f"{stats.get('scheduled_tokens', 0):,} in trees"
                                               if data.kind == "conversation" else ""))
    return Reporter(prior.out, main=procs.main, progress=config.progress, total=total, initial=start, header=header,
                    history=history, evals=evals, log=procs.say, accelerator=procs.accelerator,
                    run_name=config.run_name)


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What the steps of a run share once it is set up."""
    config: TrainConfig
    prior: _Prior
    procs: _Processes
    loaded: _Loaded
    parts: _Parts
    fingerprint: dict[str, Any]
    total: int
    start: int  # the step it starts from (a resumed checkpoint's)
    reporter: Reporter


def _save(run: _Run, at: int, *, plot: bool = True) -> None:
    """A checkpoint of step ``at`` (the metrics log flushed first: it holds every step up to it); the loss curve."""
    reporter, parts = run.reporter, run.parts
    reporter.flush()
    state = {"config": run.config.to_dict(), "history": reporter.history, "evals": reporter.evals,
             "world_size": run.procs.world, "total_steps": run.total, "run_id": run.prior.run_id,
             "fingerprint": run.fingerprint}
    path = save_checkpoint(run.procs.accelerator, parts.model, parts.optimizer, parts.scheduler,
                           output_dir=run.prior.out, step=at, state=state, keep=run.config.save_total_limit)
    if plot:
        reporter.plot()
    if reporter.bar is None:
        run.procs.say(f"saved checkpoint {path}")


def _step_loop(run: _Run) -> Generator[dict[str, Any], None, tuple[int, float, int]]:
    """The optimizer steps, each yielded, with evals and checkpoints on schedule; returns the last step, this
    call's seconds and tokens. A stop between updates (Ctrl-C, SIGTERM, an error) writes status "stopped" and,
    on one process, a checkpoint of the last step to resume from.

    Step k + 1 is launched before step k is read (:class:`~onepass.train.run.step.InFlight`): the host plans and
    queues the next step while the device runs this one. A step after which an eval or a checkpoint is due,
    and the last one, are read before anything else runs."""
    config, reporter, stepper, model = run.config, run.reporter, run.parts.stepper, run.parts.model
    inflight, step, totals = InFlight(stepper), run.start, {"seconds": 0.0, "tokens": 0}

    def logged(record: dict[str, Any]) -> dict[str, Any]:
        for key in totals:
            totals[key] += record[key]
        reporter.log_step(record, write=record["step"] % config.logging_steps == 0 or record["step"] == run.total)
        return record

    try:
        model.train()
        while step < run.total:
            inflight.launch(step)
            step += 1
            evals, saves = _due(run, step)
            for record in inflight.ready(now=evals or saves or step == run.total):  # the step before, now queued
                yield logged(record)
            deliver(stepper.held)  # a stop that arrived during the update stops the run now that the step counts
            if evals:
                reporter.log_eval(step, evaluate(run.procs.accelerator, model, run.loaded.eval_data, config,
                                                 run.procs.dims, stepper.shapes))
            if saves:
                _save(run, step)
    except GeneratorExit:  # train_steps abandoned by its caller: not an interruption to checkpoint
        reporter.close()
        raise
    except BaseException as e:  # Ctrl-C, SIGTERM or an error between updates: keep what was trained (one process)
        stop, step = _stopped(run, inflight, logged, e, step)
        if stop is not e:
            raise stop from None
        raise
    return step, totals["seconds"], totals["tokens"]


def _due(run: _Run, step: int) -> tuple[bool, bool]:
    """(an eval, a checkpoint) due after step ``step`` (the last step's come with the end)."""
    config, within = run.config, step < run.total
    return (bool(run.loaded.eval_data is not None and config.eval_steps and step % config.eval_steps == 0 and within),
            bool(config.save_steps and step % config.save_steps == 0 and within))


def _stopped(run: _Run, inflight: InFlight, logged: Callable[[dict[str, Any]], Any], error: BaseException,
             step: int) -> tuple[BaseException, int]:
    """A run stopped by ``error`` after launching ``step`` steps: the steps launched are read (one may be the
    first that was not finite: the run's last good step is then the one before it), status "stopped", a
    checkpoint of the last good step on one process. Returns the error to raise and that step."""
    stepper, reporter = run.parts.stepper, run.reporter
    stop = inflight.drain(logged) or error
    if isinstance(stop, NonFiniteError):  # that step and any launched after it were skipped on the device
        step = stop.step - 1
    reporter.close()
    reporter.write(status=f"stopped at step {step}" + (" (non-finite loss)" if isinstance(stop, NonFiniteError)
                                                       else ""))
    if run.procs.world == 1 and not stepper.updating and step > run.start:
        run.procs.say(f"interrupted after step {step}: saving a checkpoint to resume from")
        try:
            _save(run, step)
        except OnePassError as unsaved:  # weights not finite, a full disk: said; the stop stays the error
            run.procs.say(f"no checkpoint of step {step}: {unsaved}")
    return stop, step


def _finish(run: _Run, step: int) -> tuple[float | None, Path | None]:
    """The end: the final eval (to the trackers, which close after it), the last checkpoint, the final model;
    returns the final eval loss and the final model's folder. Status "finishing" until ``_done`` writes
    "finished"; a failure here leaves "stopped ... while finishing", never "finishing"."""
    config, reporter, procs, model = run.config, run.reporter, run.procs, run.parts.model
    eval_data, accelerator = run.loaded.eval_data, procs.accelerator
    reporter.write_summary(status="finishing")  # "finished" is written last, once the final save is done
    try:
        try:  # the final eval reaches the trackers: they close after it
            final_eval = (evaluate(accelerator, model, eval_data, config, procs.dims, run.parts.stepper.shapes)
                          if eval_data is not None else None)
            if final_eval is not None:
                reporter.log_eval(step, final_eval)
        finally:
            reporter.close()
        if run.start < run.total or run.prior.ckpt is None:
            _save(run, step, plot=False)
        final_dir = None
        if config.save_model:
            state_dict = accelerator.get_state_dict(model) if is_sharded(accelerator) else None
            if procs.main:
                final_dir = _save_final(accelerator.unwrap_model(model), run.loaded, run.prior.out / "final",
                                        step=step, state_dict=state_dict)
                procs.say(f"saved the {'adapter' if config.finetune != 'full' else 'model'} to {final_dir}")
            accelerator.wait_for_everyone()
    except BaseException as e:  # never left "finishing": the trained steps are counted, the end did not happen
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        reporter.write(status=f"stopped at step {step} while finishing ({reason})")
        raise
    return final_eval, final_dir


def _done(run: _Run, step: int, *, final_eval: float | None, final_dir: Path | None, seconds: float,
          tokens: int) -> TrainResult:
    """The loss curve, status "finished" with the summary, the last line logged; the run's result."""
    reporter = run.reporter
    plot = reporter.plot()
    summary = {"status": "finished", "steps": step, "final_loss": reporter.history[-1]["loss"],
               "eval_loss": final_eval, "train_seconds": seconds, "train_tokens": tokens}
    shapes = run.parts.stepper.shapes
    if shapes is not None:  # flex_attention: what compiled, per length bucket (recompiles: 0 when each shape did once)
        summary["compiles"] = shapes.summary()
        run.procs.say(f"flex_attention compiles: {shapes.summary()['compiles']}, recompiles {shapes.recompiles}")
    reporter.write(**summary)
    run.procs.say(f"done: {step} steps, final loss {summary['final_loss']:.4f}"
                  + (f", eval loss {final_eval:.4f}" if final_eval is not None else "")
                  + f"; metrics {reporter.metrics_path}" + (f", curve {plot}" if plot else ""))
    return TrainResult(output_dir=run.prior.out, steps=step, losses=[r["loss"] for r in reporter.history],
                       eval_loss=final_eval, final_dir=final_dir, metrics_path=reporter.metrics_path,
                       plot_path=plot, seconds=seconds, tokens=tokens)


def run(args: argparse.Namespace) -> int:
    """``onepass train`` (flags: :mod:`onepass.train.cli`): 0 when the run finished. Bad settings raise a
    OnePassError (one line)."""
    setup_logging()
    config = load_config(args.config, overrides_from_args(args))
    train(config, resume=args.resume, resume_anyway=args.resume_anyway)
    shutdown()  # after a finished run only: a rank that failed must not wait in a collective for the others
    return 0


__all__ = ["TrainResult", "run", "train", "train_steps"]
