"""A drop-in ``transformers.Trainer`` for one-pass rows (and so DeepSpeed, FSDP, callbacks, hub push).

Why this module exists: many users already drive training through HF's
``Trainer`` (directly, or through TRL, LLaMA-Factory or axolotl, which
subclass it). :class:`OnePassTrainer` takes what TRL's ``SFTTrainer`` takes
(``model`` as a name or a model, ``args``, ``train_dataset``/``eval_dataset``
of conversations or of rows, ``processing_class``, ``peft_config``), so a TRL
script becomes a one-pass script by changing the import and the class names
(``docs/train.md``; ``tests/train/test_sft_scripts.py``). It keeps everything
the Trainer does and changes only what one-pass needs:

- a dataset item is one **conversation** (its trees concatenated into one
  row, see :func:`conversation_dataset`), so a one-pass run and an N-pass run
  over the same conversations take the same optimizer steps;
- the collator stacks rows and pads them with self-only, untrained positions;
- ``compute_loss`` builds the tree mask from ``kv_end`` for the model's
  attention backend, passes ``position_ids``, asks for logits only at targets
  and returns the weighted cross entropy divided by the sum of target weights
  of the whole optimizer step (all gradient-accumulation micro-batches, all
  processes): with token weighting that is the N-pass number of trained
  tokens, so the loss and gradients equal N-pass;
- ``train()`` first runs the exactness guard (:mod:`onepass.guard`) on a tiny
  float64 twin of the model and refuses, in one line, a model for which
  one-pass is not the N-pass loss, unless ``allow_inexact=True``.

    from datasets import load_dataset
    from onepass.train import OnePassConfig, OnePassTrainer

    dataset = load_dataset("json", data_files="chats.jsonl", split="train")   # a messages column
    args = OnePassConfig("out", schedule="one-pass", max_length=8192, learning_rate=1e-4)
    trainer = OnePassTrainer(model="Qwen/Qwen3-0.6B", args=args, train_dataset=dataset,
                             processing_class=tokenizer, peft_config=LoraConfig(r=16))
    trainer.train()

Load the model with a backend that serves a tree mask: ``flex_attention`` on
CUDA, ``onepass_cpu`` on CPU (call :func:`onepass.attention.default_backend`
first, it registers it), or ``sdpa`` / ``eager`` anywhere. DeepSpeed and FSDP
come from ``TrainingArguments`` as usual; DataParallel (several GPUs in one
process) is refused: launch with ``torchrun`` or ``accelerate launch``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from onepass.attention.backends import check_backend, model_backend
from onepass.conversation import Conversation
from onepass.loss import ForwardView, batch_loss, layouts_to_batch
from onepass.prepare import PrepareConfig, load_rows
from onepass.render import RenderConfig
from onepass.tree import COLUMNS, Layout, concat, row_from_columns, rows_to_columns

log = logging.getLogger("onepass")


def _base_model(model: Any) -> Any:
    base = getattr(model, "get_base_model", None)  # peft
    return base() if callable(base) else model


def rows_dataset(rows: Sequence[Layout]) -> Any:
    """A ``datasets.Dataset`` with the five row columns, one item per row."""
    import datasets

    if not rows:
        raise ValueError("no rows to make a dataset of")
    return datasets.Dataset.from_dict(rows_to_columns(rows))


def conversation_dataset(conversations: Iterable[Conversation], tokenizer: Any, *, schedule: str = "one-pass",
                         max_tokens: int | None = None, weighting: str = "token",
                         render: RenderConfig | None = None, return_stats: bool = False) -> Any:
    """One item per conversation: the trees ``schedule`` makes of it, concatenated into one row.

    Conversations whose views are all skipped (template errors, over ``max_tokens``)
    are left out, counted in the returned :class:`~onepass.prepare.PrepareStats`
    (``return_stats=True``) and logged as a warning with the first reason.
    """
    from onepass.train.data import conversation_units

    config = PrepareConfig(schedule=schedule, max_tokens=max_tokens, pack=False, weighting=weighting,
                           render=render or RenderConfig())
    conversations = list(conversations)
    units, stats = conversation_units(conversations, tokenizer, config)
    if stats.skipped:
        log.warning("onepass: skipped %s", stats.skip_summary())
    if not units:
        first = stats.skipped[0] if stats.skipped else "no conversations were given"
        raise ValueError(f"no trainable conversations; first skip: {first}")
    ds = rows_dataset([concat(u) for u in units])
    # what OnePassTrainer's exactness guard checks on (lost if the dataset is mapped: then it uses
    # the bundled MathChat pair); an n-pass dataset needs no check
    ds.onepass_guard = {"schedule": schedule, "conversations": conversations[:32], "tokenizer": tokenizer,
                        "render": render}
    return (ds, stats) if return_stats else ds


def _columns(ds: Any) -> list[str]:
    names = getattr(ds, "column_names", None)
    if names is None:  # an IterableDataset of unknown features: its first item says
        first = next(iter(ds), None)
        names = list(first) if isinstance(first, Mapping) else []
    return list(names)


def parse_dataset(ds: Any, *, source: str) -> list[Conversation]:
    """The conversations of a ``datasets.Dataset`` / ``IterableDataset`` (or a list of records), in any
    shape :func:`onepass.conversation.parse_record` reads (the column is detected). A record that is not a
    conversation is a counted skip, logged with the first reason; none left is a :class:`DataError`."""
    from onepass.data.load import RawRecord, parse_records
    from onepass.errors import DataError

    skipped: list[str] = []
    raws = (RawRecord(source=source, index=i, unit="record", record=r) for i, r in enumerate(ds))
    convs = list(parse_records(raws, strict=False, skipped=skipped))
    if skipped:
        log.warning("onepass: skipped %d of %d records of %s; first: %s", len(skipped), len(skipped) + len(convs),
                    source, skipped[0])
    if not convs:
        raise DataError(f"{source} has no conversations"
                        + (f"; first skip: {skipped[0]}" if skipped else " (it is empty)"))
    return convs


def as_rows(ds: Any, tokenizer: Any, args: Any, *, source: str) -> Any:
    """What :class:`OnePassTrainer` trains on: prepared rows pass through; conversations (a ``messages``,
    ``conversations`` or ``interactions`` column, or ShareGPT records) become :func:`conversation_dataset`
    items with ``args``' schedule, max_tokens, weighting and template settings."""
    from onepass.errors import UsageError

    if ds is None or set(COLUMNS) <= set(_columns(ds)):
        return ds
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise UsageError(f"{source} holds conversations: pass processing_class=tokenizer to render them")
    render = args.render_config() if hasattr(args, "render_config") else None
    return conversation_dataset(parse_dataset(ds, source=source), tokenizer,
                                schedule=getattr(args, "schedule", "one-pass"),
                                max_tokens=getattr(args, "max_tokens", None),
                                weighting=getattr(args, "weighting", "token"), render=render)


def prepared_dataset(path: str | Path) -> Any:
    """The rows written by ``onepass prepare`` as a dataset (one item per row).

    Packed rows mix conversations, so a one-pass and an N-pass prepared set make
    different steps; use :func:`conversation_dataset` when the two must match step for step.
    """
    return rows_dataset(load_rows(path))


@dataclass
class OnePassCollator:
    """Stacks rows into ``[B, L]`` tensors (``input_ids``, ``position_ids``, ``kv_end``, ``targets``, ``weights``)."""

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = []
        for i, f in enumerate(features):
            missing = [k for k in COLUMNS if k not in f]
            if missing:
                raise ValueError(f"dataset item {i} has no {', '.join(missing)}; onepass rows need "
                                 f"{', '.join(COLUMNS)} (see onepass.train.hf_trainer.conversation_dataset)")
            rows.append(row_from_columns(f))
        return layouts_to_batch(rows)


def _load_model(model: str, args: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, **(getattr(args, "model_init_kwargs", None) or {}))


def _with_template(tokenizer: Any, args: Any) -> Any:
    path = getattr(args, "chat_template_path", None)
    if path is not None and tokenizer is not None:
        from onepass.tokenizer import read_template

        tokenizer.chat_template = read_template(path)
    return tokenizer


class OnePassTrainer(Trainer):
    """``transformers.Trainer`` whose loss is the one-pass loss, normalised as N-pass (see module doc).

    Takes what TRL's ``SFTTrainer`` takes: ``model`` (a model, or a hub id / directory to load),
    ``args`` (:class:`~onepass.train.hf_config.OnePassConfig` or any ``TrainingArguments``),
    ``train_dataset`` / ``eval_dataset`` (conversations in any shape onepass reads, or prepared rows),
    ``processing_class`` (the tokenizer: renders conversations, saved with every checkpoint) and
    ``peft_config``.
    """

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *, peft_config: Any = None,
                 allow_inexact: bool | None = None, exactness_conversations: Sequence[Conversation] | None = None,
                 **kwargs: Any) -> None:
        """``allow_inexact`` (default: ``args.allow_inexact``): train even when the exactness guard
        (:mod:`onepass.guard`, run at the start of :meth:`train`) finds that one-pass is not the
        N-pass loss for this model; ``exactness_conversations``: what it checks on (default: the
        conversations :func:`conversation_dataset` kept, else the bundled MathChat pair)."""
        from onepass.train.hf_config import OnePassConfig

        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = OnePassConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-onepass")
        if isinstance(model, str):
            if processing_class is None:
                from transformers import AutoTokenizer

                processing_class = AutoTokenizer.from_pretrained(model)
            model = _load_model(model, args)
        processing_class = _with_template(processing_class, args)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        train_dataset = as_rows(train_dataset, processing_class, args, source="train_dataset")
        if isinstance(eval_dataset, Mapping):
            eval_dataset = {k: as_rows(v, processing_class, args, source=f"eval_dataset[{k!r}]")
                            for k, v in eval_dataset.items()}
        else:
            eval_dataset = as_rows(eval_dataset, processing_class, args, source="eval_dataset")
        super().__init__(model=model, args=args, data_collator=data_collator or OnePassCollator(),
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        self.allow_inexact = getattr(args, "allow_inexact", False) if allow_inexact is None else allow_inexact
        self.exactness_conversations = exactness_conversations
        self.exactness: Any = None  # the guard's GuardResult, once train() ran it
        if self.args.n_gpu > 1:
            raise ValueError(f"OnePassTrainer does not run DataParallel over {self.args.n_gpu} GPUs in one "
                             "process; launch one process per GPU with torchrun or accelerate launch")
        unwrapped = self.accelerator.unwrap_model(self.model)
        check_backend(model_backend(unwrapped), self.args.device)
        self.label_names = ["targets"]
        # compute_loss divides by the step's weight sum itself: no extra division by grad-accum steps
        self.model_accepts_loss_kwargs = True

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, running the parallelism the launcher asked for: FSDP on CPU ranks too
        (accelerate alone runs DDP there), anything else asked for and not had is an error
        (:mod:`onepass.train.distributed`)."""
        from onepass.train.distributed import honour_request

        super().create_accelerator_and_postprocess()
        fsdp = getattr(self.args, "fsdp_plugin_args", None)  # TrainingArguments(fsdp=...) asks without the launcher
        fsdp = fsdp if fsdp and self.args.world_size > 1 else None
        self.distributed = honour_request(self.accelerator, asked="fsdp" if fsdp else None, fsdp_plugin_args=fsdp)
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    def check_exactness(self) -> Any:
        """The exactness guard on a tiny float64 twin of the model; raises
        :class:`onepass.guard.InexactModelError` (one line) unless ``allow_inexact``."""
        from onepass.guard import check_exact_once, enforce, views_for_check

        kept = getattr(self.train_dataset, "onepass_guard", None) or {}
        if kept.get("schedule") == "n-pass":  # one view per row, no packing: nothing to check
            self.exactness = {"checked": False, "why": "n-pass rows are each one plain sequence"}
            return self.exactness
        convs = self.exactness_conversations or kept.get("conversations") or []
        tokenizer = kept.get("tokenizer") or self.processing_class
        views, where = views_for_check(convs, tokenizer if hasattr(tokenizer, "apply_chat_template") else None,
                                       kept.get("render"), source="the training conversations")
        model = self.accelerator.unwrap_model(self.model)
        result = check_exact_once(model, views, backend=model_backend(_base_model(model)))
        enforce(result, allow_inexact=self.allow_inexact,
                hint="train with schedule='n-pass', or pass allow_inexact=True to train anyway",
                log=lambda line: log.info("exactness guard on %s: %s", where, line))
        self.exactness = result
        return result

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` after the exactness guard (:meth:`check_exactness`)."""
        if self.exactness is None:
            self.check_exactness()
        return super().train(*args, **kwargs)

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            self._signature_columns = list(COLUMNS)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """The sum of target weights of the optimizer step, over every micro-batch and process."""
        if not batch_samples:
            return None
        total = torch.stack([b["weights"].sum() for b in batch_samples]).sum().to(device=device,
                                                                                   dtype=torch.float64)
        if self.args.world_size > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return total

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None) -> Any:
        view = ForwardView(model, self.accelerator.unwrap_model(model))
        total = batch_loss(view, inputs)
        if num_items_in_batch is None:  # evaluation: this batch's own mean
            loss = total / inputs["weights"].sum().clamp_min(1e-12).to(total.dtype)
        else:
            # DDP / DeepSpeed average gradients over processes: undo that, the normaliser is global
            loss = total * (self.accelerator.num_processes / num_items_in_batch.to(total.dtype))
        return (loss, {"loss": loss}) if return_outputs else loss

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, None, None]:
        """Evaluation returns the loss only (logits exist only at targets)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
