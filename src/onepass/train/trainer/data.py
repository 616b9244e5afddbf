"""What ``OnePassTrainer`` trains on: datasets of conversations made into datasets of one-pass rows.

Why this module exists: TRL's ``SFTTrainer`` takes a dataset of conversations
and prepares it (render, tokenize, pack) with ``SFTConfig``'s data settings;
:class:`~onepass.train.trainer.trainer.OnePassTrainer` takes the same datasets and
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
here and by :mod:`onepass.train.trainer.records` (which sorts a trainer's records by TRL's dataset types and hands
the conversations here). What the exactness guard checks on (the schedule, some of the conversations,
the tokenizer, the render settings) comes back with the rows as :class:`GuardInputs`, which the
trainer hands to the guard (``OnePassTrainer.check_exactness``); rows given as they are have none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onepass.conversation.parse import Conversation
from onepass.data.sources import RawRecord, parse_records
from onepass.prepare.config import DataConfig
from onepass.errors import DataError
from onepass.prepare.guard_sample import GUARD_CONVERSATIONS, ViewSample
from onepass.loss import layouts_to_batch
from onepass.layout.pack import pack_layouts
from onepass.prepare.pipeline import PrepareStats, count_rows, count_shared, load_rows
from onepass.conversation.records import without_nulls
from onepass.render import RenderConfig
from onepass.layout.schedule import Schedule
from onepass.layout.share import share_and_pack
from onepass.train.core.units import conversation_units
from onepass.layout.tree import COLUMNS, Layout, concat, row_from_columns, rows_to_columns
from onepass.layout.view import View

log = logging.getLogger("onepass")



@dataclass(frozen=True, kw_only=True)
class GuardInputs:
    """What the exactness guard (:mod:`onepass.guard`) checks a dataset's model on: ``views``, two of
    the dataset's first conversations as its rows were rendered (:class:`onepass.prepare.guard_sample.ViewSample`:
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
                  num_proc: int | None = None, progress: bool = False, required: bool = True) -> Units:
    """The trees of each conversation (``data_config.schedule``), their statistics and the guard's inputs;
    none trainable is a ``ValueError`` where ``required`` (a batch of a stream may have none)."""
    config = data_config.replace(pack=False)  # packing happens across conversations, by the caller
    conversations = list(conversations)
    sample = ViewSample(limit=GUARD_CONVERSATIONS)
    units, stats = conversation_units(conversations, tokenizer, config, progress=progress, num_proc=num_proc or 1,
                                      sample=sample)
    if stats.skipped:
        log.warning("onepass: skipped %s", stats.skip_summary())
    if not units and required:
        raise DataError(f"nothing to train: {stats.none_trained()}")
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


def _parse_conversations(records: Sequence[tuple[int, Any]], *, source: str, required: bool = True
                         ) -> list[Conversation]:
    """``records`` (each with its index in the dataset) as conversations; a record that is not one is a
    counted skip, logged with the first reason; none left is a :class:`DataError` where ``required``."""
    skipped: list[str] = []
    raws = (RawRecord(source=source, index=i, unit="record", record=r) for i, r in records)
    convs = list(parse_records(raws, strict=False, skipped=skipped))
    if skipped:
        log.warning("onepass: skipped %d of %d records of %s; first: %s", len(skipped), len(skipped) + len(convs),
                    source, skipped[0])
    if not convs and required:
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




def prepared_dataset(path: str | Path) -> Any:
    """The rows written by ``onepass prepare`` as a dataset (one item per row).

    Packed rows mix conversations, so a one-pass and an N-pass prepared set make
    different steps; use :func:`conversation_dataset` when the two must match step for step.
    """
    return rows_dataset(load_rows(path))


@dataclass
class OnePassCollator:
    """Stacks rows into ``[B, L]`` tensors (``input_ids``, ``position_ids``, ``kv_end``, ``targets``,
    ``weights``) and ``row_tokens`` ``[B]`` (each row's length before padding: TRL's ``num_tokens``), the
    rows kept on the host beside them (:class:`onepass.batch.HostRows`: the loss plans from those, never
    reading the tensors back).

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
                                 f"{', '.join(COLUMNS)} (see onepass.train.trainer.data.conversation_dataset)")
            rows.append(row_from_columns(f))
        if self.padding_free:
            rows = [concat(rows)]
        length = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = layouts_to_batch(rows, length=length)
        batch["row_tokens"] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        return batch
