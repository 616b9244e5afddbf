"""What ``OnePassTrainer`` trains on: datasets of conversations made into datasets of one-pass rows.

Why this module exists: TRL's ``SFTTrainer`` takes a dataset of conversations
and prepares it (render, tokenize, pack) with ``SFTConfig``'s data settings;
:class:`~onepass.train.hf_trainer.OnePassTrainer` takes the same datasets and
settings, and this module does the preparing: parse the records (any shape
onepass reads, after ``formatting_func``), render each conversation's views
and lay them out as trees (``schedule``, ``max_length``; ``dataset_num_proc``
processes, with a progress bar), then one item per conversation (its trees
concatenated) or, with ``packing``, rows of ``max_length`` tokens of trees of
several conversations (best-fit decreasing), as TRL's packed rows.

The unit of ``per_device_train_batch_size`` follows: without packing an item is
one conversation (TRL: one conversation, truncated to ``max_length``); with
packing it is one row of at most ``max_length`` tokens (TRL: the same).

    conversations [c0: 300 tokens as one tree, c1: 900, c2: 500], max_length 1024
    packing=False  items [c0] [c1] [c2]            3 items, batch size counts conversations
    packing=True   rows  [c1] [c2 c0]              2 rows of <= 1024 tokens, batch size counts rows

The settings are one :class:`~onepass.prepare.config.DataConfig` (``OnePassConfig.data_config``), read
here and nowhere else. What the exactness guard checks on (the schedule, some of the conversations,
the tokenizer, the render settings) comes back with the rows as :class:`GuardInputs`, which the
trainer hands to the guard (``OnePassTrainer.check_exactness``); rows given as they are have none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onepass.conversation.parse import Conversation
from onepass.conversation.sources import RawRecord, parse_records
from onepass.prepare.config import DataConfig
from onepass.errors import DataError, UsageError
from onepass.guard.sample import GUARD_CONVERSATIONS, ViewSample
from onepass.loss import layouts_to_batch
from onepass.layout.pack import pack_layouts
from onepass.prepare.pipeline import PrepareStats, count_rows, count_shared, load_rows
from onepass.conversation.records import without_nulls
from onepass.render import RenderConfig
from onepass.layout.schedule import Schedule
from onepass.layout.share import share_and_pack
from onepass.train import sft_rows
from onepass.train.data import conversation_units
from onepass.train.hf_config import OnePassConfig
from onepass.train.sft_rows import SftSettings
from onepass.layout.tree import COLUMNS, Layout, concat, row_from_columns, rows_to_columns
from onepass.layout.view import View

log = logging.getLogger("onepass")



@dataclass(frozen=True, kw_only=True)
class GuardInputs:
    """What the exactness guard (:mod:`onepass.guard`) checks a dataset's model on: ``views``, two of
    the dataset's first conversations as its rows were rendered (:class:`onepass.guard.sample.ViewSample`:
    nothing rendered twice); the conversations, ``tokenizer`` and ``render`` settings they came from
    (what a check of other conversations renders with); under an ``n-pass`` schedule there is nothing
    to check (each row is one plain sequence)."""

    schedule: Schedule
    conversations: tuple[Conversation, ...]
    tokenizer: Any
    render: RenderConfig
    views: list[list[View]] | None = None  # None: render the conversations for the check


@dataclass(frozen=True, kw_only=True)
class PreparedRows:
    """A dataset of one-pass rows and what the guard needs of it (None: rows given as they are)."""

    dataset: Any
    guard: GuardInputs | None = None
    stats: PrepareStats | None = field(default=None, repr=False)


def rows_dataset(rows: Sequence[Layout], **extra: Sequence[Any]) -> Any:
    """A ``datasets.Dataset`` with the five row columns, one item per row (and ``extra`` columns, one value
    per row: ``labels``, ``seq_lengths``)."""
    import datasets

    if not rows:
        raise ValueError("no rows to make a dataset of")
    return datasets.Dataset.from_dict({**rows_to_columns(rows), **{k: list(v) for k, v in extra.items()}})


def conversation_dataset(conversations: Iterable[Conversation], tokenizer: Any, *, schedule: str = "one-pass",
                         max_tokens: int | None = None, weighting: str = "token",
                         render: RenderConfig | None = None, return_stats: bool = False, packing: bool = False,
                         num_proc: int | None = None, progress: bool = False,
                         data_config: DataConfig | None = None) -> Any:
    """One item per conversation (the trees ``schedule`` makes of it, concatenated into one row), or
    with ``packing`` rows of at most ``max_tokens`` tokens of whole trees of any conversations.

    ``data_config`` gives the settings as one record instead of ``schedule``, ``max_tokens``,
    ``weighting`` and ``render``. Conversations whose views are all skipped (template errors, over
    ``max_tokens``) are left out, counted in the returned :class:`~onepass.prepare.pipeline.PrepareStats`
    (``return_stats=True``) and logged as a warning with the first reason. ``num_proc`` processes
    render them.
    """
    if data_config is None:
        render = render or RenderConfig()
        data_config = DataConfig(schedule=schedule, max_tokens=max_tokens, weighting=weighting,
                                 completion_format=render.completion_format, reasoning=render.reasoning,
                                 train_turns=render.train_turns,
                                 template_kwargs=dict(render.template_kwargs), template_date=render.template_date)
    out = prepare_rows(conversations, tokenizer, data_config, packing=packing, num_proc=num_proc, progress=progress)
    return (out.dataset, out.stats) if return_stats else out.dataset


@dataclass(frozen=True, kw_only=True)
class Units:
    """Conversations rendered and laid out: one unit (its trees) per conversation that keeps a view."""

    units: list[list[Layout]]
    stats: PrepareStats
    guard: GuardInputs


def prepare_units(conversations: Iterable[Conversation], tokenizer: Any, data_config: DataConfig, *,
                  num_proc: int | None = None, progress: bool = False) -> Units:
    """The trees of each conversation (``data_config.schedule``), their statistics and the guard's inputs."""
    config = data_config.replace(pack=False)  # packing happens across conversations, by the caller
    conversations = list(conversations)
    sample = ViewSample(limit=GUARD_CONVERSATIONS)
    units, stats = conversation_units(conversations, tokenizer, config, progress=progress, num_proc=num_proc or 1,
                                      sample=sample)
    if stats.skipped:
        log.warning("onepass: skipped %s", stats.skip_summary())
    if not units:
        first = stats.skipped[0] if stats.skipped else "no conversations were given"
        raise ValueError(f"no trainable conversations; first skip: {first}")
    guard = GuardInputs(schedule=config.schedule_spec, conversations=tuple(conversations[:GUARD_CONVERSATIONS]),
                        tokenizer=tokenizer, render=config.render, views=sample.views())
    return Units(units=units, stats=stats, guard=guard)


def prepare_rows(conversations: Iterable[Conversation], tokenizer: Any, data_config: DataConfig, *,
                 packing: bool = False, num_proc: int | None = None, progress: bool = False) -> PreparedRows:
    """:func:`conversation_dataset`'s rows, their statistics and the guard's inputs (:class:`GuardInputs`)."""
    max_tokens = data_config.max_tokens
    if packing and max_tokens is None:
        raise ValueError("packing needs a row length: set max_length")
    out = prepare_units(conversations, tokenizer, data_config, num_proc=num_proc, progress=progress)
    units, stats = out.units, out.stats
    if packing:
        assert max_tokens is not None
        packed = data_config.replace(pack=True)
        trees = [tree for unit in units for tree in unit]
        if packed.shares:  # trees of conversations that share a prefix: one tree per row (onepass.layout.share)
            shared = share_and_pack(trees, [u for u, unit in enumerate(units) for _ in unit], max_tokens,
                                    window=packed.share_window)
            rows = shared.rows
            count_shared(stats, packed, trees, [g for g in shared.groups if len(g) > 1])
        else:
            rows = pack_layouts(trees, max_tokens)
        count_rows(stats, packed, num_trees=len(trees), num_rows=len(rows), row_tokens=sum(len(r) for r in rows))
    else:
        rows = [concat(u) for u in units]
    return PreparedRows(dataset=rows_dataset(rows), guard=out.guard, stats=stats)


def _columns(ds: Any) -> list[str]:
    names = getattr(ds, "column_names", None)
    if names is None:  # an IterableDataset of unknown features: its first item says
        first = next(iter(ds), None)
        names = list(first) if isinstance(first, Mapping) else []
    return list(names)


def parse_dataset(ds: Any, *, source: str, formatting_func: Callable[[dict], Any] | None = None,
                  text_field: str = "text") -> list[Conversation]:
    """The conversations of a ``datasets.Dataset`` / ``IterableDataset`` (or a list of records), in any
    shape :func:`onepass.conversation.parse.parse_record` reads (the column is detected), each record first
    passed through ``formatting_func`` when given. A record that is not a conversation is a counted
    skip, logged with the first reason; none left is a :class:`DataError`."""
    rows: Iterable[Any] = ds if isinstance(ds, (list, tuple)) else (without_nulls(r) for r in ds)  # Arrow's nulls
    records = rows if formatting_func is None else (_formatted(formatting_func, r, text_field) for r in rows)
    return _parse_conversations(list(enumerate(records)), source=source)


def _parse_conversations(records: Sequence[tuple[int, Any]], *, source: str) -> list[Conversation]:
    """``records`` (each with its index in the dataset) as conversations; a record that is not one is a
    counted skip, logged with the first reason; none left is a :class:`DataError`."""
    skipped: list[str] = []
    raws = (RawRecord(source=source, index=i, unit="record", record=r) for i, r in records)
    convs = list(parse_records(raws, strict=False, skipped=skipped))
    if skipped:
        log.warning("onepass: skipped %d of %d records of %s; first: %s", len(skipped), len(skipped) + len(convs),
                    source, skipped[0])
    if not convs:
        raise DataError(f"{source} has no conversations"
                        + (f"; first skip: {skipped[0]}" if skipped else " (it is empty)"))
    return convs


def _formatted(formatting_func: Callable[[dict], Any], record: Any, text_field: str) -> Any:
    """``formatting_func(record)`` as a record: text (TRL's use: a language-modeling record), a list of
    messages, or a mapping."""
    out = formatting_func(record)
    if isinstance(out, str):
        return {text_field: out}
    return {"messages": out} if isinstance(out, list) else out


def _settings(args: OnePassConfig, tokenizer: Any, packing: bool) -> Any:
    """TRL's tokenizing and labelling settings of ``args`` (:class:`onepass.train.sft_rows.SftSettings`)."""
    return SftSettings(text_field=args.dataset_text_field, completion_only_loss=args.completion_only_loss,
                       assistant_only_loss=bool(args.assistant_only_loss),
                       chat_template=training_template(tokenizer) if args.assistant_only_loss else None,
                       template_kwargs=dict(args.template_kwargs or {}), template_date=args.template_date,
                       max_length=args.max_length,
                       truncation_mode=args.truncation_mode, truncate=not packing)


def has_generation_markers(template: Any) -> bool:
    import re

    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def training_template(tokenizer: Any) -> str | None:
    """The chat template to read TRL's assistant masks with: the tokenizer's when it has ``{% generation %}``
    markers (None: use it as it is), else TRL's training version of it (trl's ``get_training_chat_template``);
    without trl, or for a template TRL does not know, one line."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None or has_generation_markers(template):
        return None
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        get_training_chat_template = None
    if get_training_chat_template is not None:
        try:
            return get_training_chat_template(tokenizer)
        except ValueError:
            pass

    raise UsageError("assistant_only_loss=True on prompt-completion or TRL-rendered rows needs a chat template "
                     "with {% generation %} markers (or trl installed, which has training templates of known "
                     "models); conversations in a messages column train their assistant turns by default")


@dataclass(frozen=True, kw_only=True)
class _Sorted:
    """A dataset's records by kind: conversations (one-pass) and TRL rows, each with its record index."""

    conversations: list[tuple[int, Any]]
    trl_rows: list[tuple[int, Any]]  # SftRow


def _records(ds: Any) -> Iterable[Any]:
    return ds if isinstance(ds, (list, tuple)) else (without_nulls(r) for r in ds)  # Arrow's nulls


def _sort_records(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str,
                  formatting_func: Callable[[dict], Any] | None, packing: bool) -> _Sorted:
    """Each record as TRL's kind says: conversations stay records (rendered one-pass later); every other
    kind becomes TRL's row (:mod:`onepass.train.sft_rows`), truncated as TRL truncates it."""
    settings = None
    convs: list[tuple[int, Any]] = []
    rows: list[tuple[int, Any]] = []
    for i, record in enumerate(_records(ds)):
        if formatting_func is not None and not (isinstance(record, Mapping) and "input_ids" in record):
            record = _formatted(formatting_func, record, args.dataset_text_field)
        if not isinstance(record, Mapping):
            convs.append((i, record))  # parse_record names what is wrong
            continue
        if sft_rows.is_sharegpt(record) and args.assistant_only_loss is False:
            record = {**record, "messages": [{"role": m.get("from"), "content": m.get("value")}
                                             for m in record["conversations"]]}
        kind = sft_rows.record_kind(record, args.dataset_text_field)
        if kind == sft_rows.MESSAGES and not (args.assistant_only_loss is False and "messages" in record):
            convs.append((i, record))
            continue
        settings = settings or _settings(args, tokenizer, packing)
        row = sft_rows.truncated(sft_rows.tokenize_record(record, kind, tokenizer, settings), settings)
        if settings.truncate and not row.trained:
            continue  # TRL drops an example truncation left without a trained token
        rows.append((i, row))
    return _Sorted(conversations=convs, trl_rows=rows)


def as_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, packing: bool | None = None,
            formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """What :class:`OnePassTrainer` trains on, with a ``labels`` view of each row
    (:func:`onepass.train.sft_rows.labels_view`) and, packed, TRL's ``seq_lengths``:

    - one-pass rows (the five columns) pass through (no :class:`GuardInputs`);
    - conversations (a ``messages``, ``conversations`` or ``interactions`` column, ShareGPT records, ...)
      become :func:`prepare_rows` items with ``args.data_config``, each record's ``chat_template_kwargs``
      over the run's ``template_kwargs``;
    - every other record of TRL's dataset types (text, prompt-completion, tokenized ``input_ids``; and
      conversations under ``assistant_only_loss=False``) becomes TRL's row, a plain causal sequence
      (:mod:`onepass.train.sft_rows`); a dataset may mix them.
    """
    packing = bool(args.packing if packing is None else packing)
    if ds is None or set(COLUMNS) <= set(_columns(ds)):
        return PreparedRows(dataset=ds)
    _check_custom_format(ds)
    columns = _columns(ds)
    if args.dataset_prepared:
        if "input_ids" in columns:
            return PreparedRows(dataset=_given_rows(ds, source))
        raise UsageError(f"{source}: dataset_kwargs skip_prepare_dataset=True needs one-pass rows "
                         f"({', '.join(COLUMNS)}) or tokenized rows (input_ids, labels), got columns "
                         f"{', '.join(columns)}")
    if "input_ids" in columns and formatting_func is not None:
        log.warning("onepass: %s is tokenized already (an input_ids column): formatting_func is ignored", source)
    if (tokenizer is None or not hasattr(tokenizer, "apply_chat_template")) and "input_ids" not in columns:
        raise UsageError(f"{source} holds conversations: pass processing_class=tokenizer to render them")
    sorted_ = _sort_records(ds, tokenizer, args, source=source, formatting_func=formatting_func, packing=packing)
    order = [i for i, _ in sorted_.conversations] + [i for i, _ in sorted_.trl_rows]
    if args.shuffle_dataset:
        import random

        random.Random(args.seed).shuffle(order)
    position = {i: k for k, i in enumerate(order)}
    conversations = sorted(sorted_.conversations, key=lambda x: position[x[0]])
    trl_rows = [r for _, r in sorted(sorted_.trl_rows, key=lambda x: position[x[0]])]
    return _rows_of(conversations, trl_rows, tokenizer, args, source=source, packing=packing)


def _check_custom_format(ds: Any) -> None:
    fmt = getattr(ds, "format", None)
    if isinstance(fmt, Mapping) and fmt.get("type") == "custom":
        raise ValueError("OnePassTrainer cannot prepare a dataset that uses `Dataset.with_transform()` (as "
                         "SFTTrainer): preparing reads through the transform and would bake a random or stateful "
                         "transform into the rows. Pass dataset_kwargs={'skip_prepare_dataset': True} and make the "
                         "transform return trainer-ready examples (one-pass rows, or input_ids and labels), or "
                         "materialize a deterministic transform with Dataset.map() first")


def _given_rows(ds: Any, source: str) -> Any:
    """``skip_prepare_dataset`` with tokenized rows: each ``input_ids`` (with its ``labels``, or every token
    trained) one causal row as it is, untruncated, as TRL's collator takes it."""
    columns = _columns(ds)
    if "labels" not in columns and any(c in columns for c in sft_rows.MASK_COLUMNS):
        raise ValueError(f"The {source} dataset has mask columns but no 'labels', and `skip_prepare_dataset=True` "
                         "skips label building, so it would train on the full sequence. Add a 'labels' column "
                         "(-100 for non-loss tokens) or drop `skip_prepare_dataset`.")
    rows = [sft_rows.SftRow(input_ids=tuple(r["input_ids"]), labels=tuple(r.get("labels") or r["input_ids"]))
            for r in _records(ds)]
    return rows_dataset([sft_rows.causal_layout(r) for r in rows], labels=[list(r.labels) for r in rows])


def _rows_of(conversations: Sequence[tuple[int, Any]], trl_rows: Sequence[Any], tokenizer: Any,
             args: OnePassConfig, *, source: str, packing: bool) -> PreparedRows:
    """The dataset of one-pass rows: the conversations' trees (grouped by their records'
    ``chat_template_kwargs``, each group rendered with them) and TRL's rows; packed when ``packing``."""
    placed: list[tuple[int, list[Layout]]] = []  # (the record's place, its trees)
    stats = None
    guard = None
    if conversations:
        groups: dict[str, list[tuple[int, Any]]] = {}
        for place, (i, record) in enumerate(conversations):
            kwargs = record.pop("chat_template_kwargs", None) if isinstance(record, dict) else None
            groups.setdefault(json.dumps(kwargs or {}, sort_keys=True), []).append((place, (i, record)))
        for key, group in groups.items():  # each group rendered with its records' chat_template_kwargs
            config = args.data_config
            if key != "{}":
                config = config.replace(template_kwargs={**dict(config.template_kwargs), **json.loads(key)})
            convs = _parse_conversations([r for _, r in group], source=source)
            out = prepare_units(convs, tokenizer, config, num_proc=args.dataset_num_proc,
                                progress=not args.disable_tqdm)
            # back in the records' order where no record of the group was skipped (else the group's order)
            places = [p for p, _ in group] if len(out.units) == len(group) else [group[0][0]] * len(out.units)
            placed.extend(zip(places, out.units))
            stats = out.stats if stats is None else stats
            guard = guard or out.guard
    units = [u for _, u in sorted(placed, key=lambda x: x[0])]
    docs = [sft_rows.causal_layout(r) for r in trl_rows]
    labels = None
    if packing:
        if args.max_length is None:
            raise ValueError("When packing is enabled, `max_length` can't be `None`.")
        trees = [tree for unit in units for tree in unit]
        if args.packing_strategy == "wrapped" and trl_rows:
            rows = pack_layouts(trees, args.max_length) if trees else []
            wrapped = sft_rows.wrapped_rows(trl_rows, args.max_length)
            rows += [sft_rows.causal_layout(r) for r in wrapped]
            labels = [list(sft_rows.labels_view(r)) for r in rows[:len(rows) - len(wrapped)]] + \
                     [list(r.labels) for r in wrapped]
        else:
            pieces = [p for r in trl_rows for p in (sft_rows.split_row(r, args.max_length)
                                                    if args.packing_strategy == "bfd_split"
                                                    else [sft_rows.truncated(r, _cut(args))])]
            rows = pack_layouts(trees + [sft_rows.causal_layout(p) for p in pieces], args.max_length)
    else:
        rows = [concat(u) for u in units] + docs
        labels = [list(sft_rows.labels_view(r)) for r in rows[:len(units)]] + [list(r.labels) for r in trl_rows]
    kept = [k for k, r in enumerate(rows) if r.num_targets]
    if len(kept) < len(rows):
        log.warning("onepass: %s: %d of %d rows train no token (nothing predicts their labelled tokens); left out",
                    source, len(rows) - len(kept), len(rows))
    if not kept:
        raise ValueError(f"no trainable rows in {source}")
    rows = [rows[k] for k in kept]
    labels = [labels[k] for k in kept] if labels is not None else [list(sft_rows.labels_view(r)) for r in rows]
    extra = {"labels": labels}
    if packing:
        extra["seq_lengths"] = [sft_rows.seq_lengths(r) for r in rows]
    return PreparedRows(dataset=rows_dataset(rows, **extra), guard=guard, stats=stats)


def _cut(args: OnePassConfig) -> Any:
    return SftSettings(max_length=args.max_length, truncation_mode="keep_start", truncate=True)


def prepared_dataset(path: str | Path) -> Any:
    """The rows written by ``onepass prepare`` as a dataset (one item per row).

    Packed rows mix conversations, so a one-pass and an N-pass prepared set make
    different steps; use :func:`conversation_dataset` when the two must match step for step.
    """
    return rows_dataset(load_rows(path))


@dataclass
class OnePassCollator:
    """Stacks rows into ``[B, L]`` tensors (``input_ids``, ``position_ids``, ``kv_end``, ``targets``,
    ``weights``) and ``row_tokens`` ``[B]`` (each row's length before padding: TRL's ``num_tokens``).

    ``padding_free``: the micro-batch's rows concatenated into one row (``B = 1``, no padding; a
    row's positions never see another's, as in separate rows). ``pad_to_multiple_of``: ``L``
    rounded up to a multiple of it.
    """

    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = []
        for i, f in enumerate(features):
            missing = [k for k in COLUMNS if k not in f]
            if missing:
                raise ValueError(f"dataset item {i} has no {', '.join(missing)}; onepass rows need "
                                 f"{', '.join(COLUMNS)} (see onepass.train.hf_data.conversation_dataset)")
            rows.append(row_from_columns(f))
        if self.padding_free:
            rows = [concat(rows)]
        length = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = layouts_to_batch(rows, length=length)
        batch["row_tokens"] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        return batch
