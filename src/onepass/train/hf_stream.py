"""The datasets ``OnePassTrainer`` is given, as rows it may train: streams read as they come, every row checked.

Why this module exists: two faults of issue 37 lived between a dataset and the Trainer. An endless
``IterableDataset`` was read whole by the constructor (which then never returned); and rows given as
they are (a dataset of the five row columns, or a stream of them) trained unchecked, so one NaN weight
made a NaN model with its loss logged 0.0. :func:`trainer_rows` is the one way in: a stream goes
through :func:`stream_rows` (rendered a batch at a time, when the Trainer reads it), anything else
through :func:`onepass.train.hf_data.as_rows`; then :func:`check_dataset_rows` checks every row as
``onepass train`` checks a prepared folder (:func:`onepass.row_check.check_rows`), all of them
before training, or, for a stream, each item as it is read.

    trainer_rows(IterableDataset of conversations)   -> rows rendered 256 conversations at a time
    trainer_rows(Dataset of rows with a NaN weight)  -> RowError: "train_dataset: row 3, weights: ..."
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from onepass.conversation import Conversation
from onepass.data.load import RawRecord, parse_records
from onepass.errors import UsageError
from onepass.pack import pack_layouts
from onepass.records import without_nulls
from onepass.row_check import check_rows
from onepass.train.data import conversation_units
from onepass.train.hf_config import OnePassConfig
from onepass.train.hf_data import (
    GUARD_CONVERSATIONS,
    GuardInputs,
    PreparedRows,
    _columns,
    _formatted,
    as_rows,
    parse_dataset,
)
from onepass.tree import COLUMNS, Layout, concat, row_from_columns, rows_to_columns

log = logging.getLogger("onepass")


def trainer_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, vocab_size: int | None,
                 packing: bool | None = None, formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """What the trainer trains (or evaluates) on: :func:`stream_rows` for a stream, else
    :func:`~onepass.train.hf_data.as_rows`; either way checked (:func:`check_dataset_rows`)."""
    prepare = stream_rows if ds is not None and is_stream(ds) else as_rows
    out = prepare(ds, tokenizer, args, source=source, packing=packing, formatting_func=formatting_func)
    return PreparedRows(dataset=check_dataset_rows(out.dataset, source=source, vocab_size=vocab_size),
                        guard=out.guard, stats=out.stats)


def is_stream(ds: Any) -> bool:
    """A dataset that is read as it comes and never whole: a ``datasets.IterableDataset`` (``streaming=True``,
    ``from_generator``) or any torch ``IterableDataset``."""
    return isinstance(ds, torch.utils.data.IterableDataset)


STREAM_BATCH = 256  # conversations rendered (and, with packing, packed) together from a stream


def stream_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, packing: bool | None = None,
                formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """:func:`as_rows` for a stream, lazily: each item is rendered (or, for rows, checked) when the Trainer
    reads it, so an endless ``IterableDataset`` trains from its first items on (the constructor used to
    read it all first, and never returned). Conversations are rendered :data:`STREAM_BATCH` at a time
    (with ``packing``, their trees are packed into rows within that batch, as TRL packs a stream); a
    skipped conversation is logged with its reason as it is met. The guard checks the first conversations.
    """
    import datasets

    if not isinstance(ds, datasets.IterableDataset):  # a torch IterableDataset: read through datasets' own
        ds = datasets.IterableDataset.from_generator(_items, gen_kwargs={"source": ds})
    if args.shuffle_dataset:
        ds = ds.shuffle(seed=args.seed)
    columns = _columns(ds)  # the first item's keys where the stream does not declare them
    if set(COLUMNS) <= set(columns):  # rows: checked as they are read (check_dataset_rows)
        return PreparedRows(dataset=ds)
    if args.dataset_prepared:
        raise UsageError(f"{source}: dataset_kwargs skip_prepare_dataset=True needs one-pass rows "
                         f"({', '.join(COLUMNS)}), got columns {', '.join(columns)}")
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise UsageError(f"{source} holds conversations: pass processing_class=tokenizer to render them")
    data_config = args.data_config.replace(pack=False)
    pack = bool(args.packing if packing is None else packing)
    if pack and data_config.max_tokens is None:
        raise ValueError("packing needs a row length: set max_length")
    first = parse_dataset(list(itertools.islice(ds, GUARD_CONVERSATIONS)), source=source,
                          formatting_func=formatting_func, text_field=args.dataset_text_field)
    guard = GuardInputs(schedule=data_config.schedule_spec, conversations=tuple(first), tokenizer=tokenizer,
                        render=data_config.render)
    seen = {"records": 0}

    def render(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:

        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        start = seen["records"]
        seen["records"] += len(records)
        convs = _parse_batch(records, source=source, start=start, formatting_func=formatting_func,
                             text_field=args.dataset_text_field)
        units, stats = conversation_units(convs, tokenizer, data_config)
        if stats.skipped:
            log.warning("onepass: %s records %d-%d: skipped %s", source, start, start + len(records) - 1,
                        stats.skip_summary())
        trees = [tree for unit in units for tree in unit]
        rows = (pack_layouts(trees, data_config.max_tokens) if pack and trees else [concat(u) for u in units])
        return rows_to_columns(rows) if rows else {c: [] for c in COLUMNS}

    return PreparedRows(dataset=ds.map(render, batched=True, batch_size=STREAM_BATCH, remove_columns=columns),
                        guard=guard)


def _items(source: Any) -> Any:
    """The items of a torch ``IterableDataset`` (a generator for ``datasets.IterableDataset.from_generator``)."""
    yield from source


def _parse_batch(records: list[Any], *, source: str, start: int, formatting_func: Callable[[dict], Any] | None,
                 text_field: str) -> list[Conversation]:
    """The conversations of a batch of a stream (counted skips logged by :func:`parse_dataset`); none is fine."""

    rows = (without_nulls(r) for r in records)
    if formatting_func is not None:
        rows = (_formatted(formatting_func, r, text_field) for r in rows)
    skipped: list[str] = []
    raws = (RawRecord(source=source, index=start + i, unit="record", record=r) for i, r in enumerate(rows))
    convs = list(parse_records(raws, strict=False, skipped=skipped))
    if skipped:
        log.warning("onepass: skipped %d of %d records of %s; first: %s", len(skipped), len(records), source,
                    skipped[0])
    return convs


def dataset_rows(ds: Any, batch_size: int = 256) -> Iterator[Layout]:
    """The rows of a dataset of the five row columns, one at a time: a ``datasets.Dataset`` read in Arrow
    batches (not the "numpy" format, which casts float columns to float32), anything else item by item."""
    if hasattr(ds, "with_format") and hasattr(ds, "iter") and hasattr(ds, "__len__"):
        for batch in ds.with_format("arrow").iter(batch_size=batch_size):
            columns = {c: batch.column(c) for c in COLUMNS}
            for i in range(batch.num_rows):
                yield row_from_columns({c: a[i].values.to_numpy(zero_copy_only=False) for c, a in columns.items()})
    else:
        for item in ds:
            yield row_from_columns(item)


def check_dataset_rows(ds: Any, *, source: str, vocab_size: int | None) -> Any:
    """The rows a trainer is given, checked as ``onepass train`` checks a prepared folder
    (:func:`onepass.row_check.check_rows`: ids within ``vocab_size``, finite non-negative weights only on
    targets, some weight > 0, ``kv_end`` the tree of ``position_ids``): one :class:`~onepass.row_check.RowError`
    line naming the row, before training. Returns the dataset to train on: a stream comes back mapped
    so that each item is checked as it is read (there is no "before" for an endless stream; a row with no
    weight is then allowed, a step with none trains nothing)."""
    if ds is None or not set(COLUMNS) <= set(_columns(ds)):  # not rows (a caller's own dataset for its collator)
        return ds
    if is_stream(ds):
        def checked(item: dict[str, Any], index: int) -> dict[str, Any]:
            check_rows([row_from_columns(item)], vocab_size=vocab_size, source=source, require_weight=False,
                       start=index, hint=ROWS_HINT)
            return item

        return ds.map(checked, with_indices=True)
    check_rows(dataset_rows(ds), vocab_size=vocab_size, source=source, hint=ROWS_HINT)
    return ds


ROWS_HINT = "make the rows with `onepass prepare` or conversation_dataset (or pass the conversations)"
