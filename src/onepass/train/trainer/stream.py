"""The datasets ``OnePassTrainer`` is given, as rows it may train: streams read as they come, every row checked.

Why this module exists: two faults of issue 37 lived between a dataset and the Trainer. An endless
``IterableDataset`` was read whole by the constructor (which then never returned); and rows given as
they are (a dataset of the five row columns, or a stream of them) trained unchecked, so one NaN weight
made a NaN model with its loss logged 0.0. :func:`trainer_rows` is the one way in: a stream goes
through :func:`stream_rows` (a batch of records at a time, when the Trainer reads it, through the same
path as a map-style dataset: every one of TRL's types, mixed too), anything else through
:func:`onepass.train.trainer.records.as_rows`; then :func:`check_dataset_rows` checks every row as
``onepass train`` checks a prepared folder (:func:`onepass.layout.row_check.check_rows`), all of them
before training, or, for a stream, each item as it is read.

    trainer_rows(IterableDataset of any TRL type)    -> the rows of the same Dataset, made 256 records at a time
    trainer_rows(Dataset of rows with a NaN weight)  -> RowError: "train_dataset: row 3, weights: ..."
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from onepass.conversation.records import without_nulls
from onepass.data.sources import RawRecord, parse_records
from onepass.prepare.guard_sample import GUARD_CONVERSATIONS
from onepass.layout.row_check import check_rows
from onepass.layout.tree import COLUMNS, Layout, row_from_columns
from onepass.train.distributed import check_stream_accelerate
from onepass.train.hf_config import OnePassConfig
from onepass.train.trainer.data import GuardInputs, PreparedRows, _columns
from onepass.train.trainer.records import (
    MadeRows,
    as_rows,
    check_preparable,
    conversation_records,
    given_rows,
    records_rows,
)

log = logging.getLogger("onepass")


def trainer_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, vocab_size: int | None,
                 packing: bool | None = None, formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """What the trainer trains (or evaluates) on: :func:`stream_rows` for a stream, else
    :func:`~onepass.train.trainer.records.as_rows`; either way checked (:func:`check_dataset_rows`)."""
    prepare = stream_rows if ds is not None and is_stream(ds) else as_rows
    out = prepare(ds, tokenizer, args, source=source, packing=packing, formatting_func=formatting_func)
    return PreparedRows(dataset=check_dataset_rows(out.dataset, source=source, vocab_size=vocab_size),
                        guard=out.guard, stats=out.stats)


def is_stream(ds: Any) -> bool:
    """A dataset that is read as it comes and never whole: a ``datasets.IterableDataset`` (``streaming=True``,
    ``from_generator``) or any torch ``IterableDataset``."""
    return isinstance(ds, torch.utils.data.IterableDataset)


def check_streams(*given: Any) -> None:
    """Any stream among ``given`` (datasets, or mappings of them) needs an accelerate that can dispatch its
    batches (:func:`onepass.train.distributed.check_stream_accelerate`): one line otherwise."""
    for ds in given:
        for one in ds.values() if isinstance(ds, Mapping) else (ds,):
            if one is not None and is_stream(one):
                check_stream_accelerate()
                return


STREAM_BATCH = 256  # records made into rows (and, with packing, packed) together from a stream


def stream_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, packing: bool | None = None,
                formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """:func:`~onepass.train.trainer.records.as_rows` for a stream, lazily: each item is made into rows (or, for rows,
    checked) when the Trainer reads it, so an endless ``IterableDataset`` trains from its first items on (the
    constructor used to read it all first, and never returned). The records are read :data:`STREAM_BATCH` at
    a time and each batch goes through :func:`~onepass.train.trainer.records.records_rows`, the map-style path, so
    every one of TRL's types (mixed too) makes the rows it makes map-style, in the same order (with
    ``packing``, packed within the batch, as TRL packs a stream); what a batch skips is logged as it is met.
    The guard checks the conversations among the first records (:func:`stream_guard`).

        stream of [text, prompt-completion, conversation] x 10   -> 30 rows, as the same records map-style
    """
    import datasets

    if not isinstance(ds, datasets.IterableDataset):  # a torch IterableDataset: read through datasets' own
        ds = datasets.IterableDataset.from_generator(_items, gen_kwargs={"source": ds})
    if args.shuffle_dataset:
        ds = ds.shuffle(seed=args.seed)
    columns = _columns(ds)  # the first item's keys where the stream does not declare them
    if set(COLUMNS) <= set(columns):  # rows: checked as they are read (check_dataset_rows)
        return PreparedRows(dataset=ds)
    pack = bool(args.packing if packing is None else packing)
    guard = None
    if args.dataset_prepared:
        given_rows([], columns, source=source)  # the columns checked now, not at the first step

        def make(records: list[Any], start: int) -> MadeRows:
            return given_rows(records, columns, source=source)
    else:
        check_preparable(columns, tokenizer, source=source, formatting_func=formatting_func)
        if pack and args.max_length is None:
            raise ValueError("When packing is enabled, `max_length` can't be `None`.")
        guard = stream_guard(ds, tokenizer, args, source=source, formatting_func=formatting_func)

        def make(records: list[Any], start: int) -> MadeRows:
            return records_rows(enumerate(records, start), tokenizer, args, source=source, packing=pack,
                                formatting_func=formatting_func, part=True)

    def rows(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        records = [without_nulls(dict(zip(batch, values))) for values in zip(*batch.values())]
        return make(records, indices[0] if indices else 0).columns()

    features = row_features(labels=True, seq_lengths=pack and not args.dataset_prepared)
    return PreparedRows(dataset=ds.map(rows, batched=True, batch_size=STREAM_BATCH, with_indices=True,
                                       remove_columns=columns, features=features), guard=guard)


def row_features(*, labels: bool = False, seq_lengths: bool = False) -> Any:
    """The features of a dataset of rows (those of :func:`~onepass.train.trainer.data.rows_dataset`), declared so
    that a mapped stream's columns are known without reading it."""
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    names = [*COLUMNS, *(["labels"] if labels else []), *(["seq_lengths"] if seq_lengths else [])]
    return datasets.Features({n: datasets.List(datasets.Value("float64")) if n == "weights" else ints
                              for n in names})


def stream_guard(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str,
                 formatting_func: Callable[[dict], Any] | None = None) -> GuardInputs | None:
    """What the exactness guard checks a stream's model on: the conversations among its first
    :data:`~onepass.prepare.guard_sample.GUARD_CONVERSATIONS` records (None where there are none, as for rows given as
    they are: the guard then checks on the bundled MathChat pair, since a stream is not read ahead)."""
    first = enumerate(without_nulls(r) for r in itertools.islice(ds, GUARD_CONVERSATIONS))
    records = conversation_records(first, args, source=source, formatting_func=formatting_func)
    convs = parse_records((RawRecord(source=source, index=i, unit="record", record=r) for i, r in records),
                          strict=False, skipped=[])
    conversations = tuple(convs)
    if not conversations:
        return None
    config = args.data_config
    return GuardInputs(schedule=config.schedule_spec, conversations=conversations, tokenizer=tokenizer,
                       render=config.render)


def _items(source: Any) -> Any:
    """The items of a torch ``IterableDataset`` (a generator for ``datasets.IterableDataset.from_generator``)."""
    yield from source


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
    (:func:`onepass.layout.row_check.check_rows`: ids within ``vocab_size``, finite non-negative weights only on
    targets, some weight > 0, ``kv_end`` the tree of ``position_ids``): one :class:`~onepass.layout.row_check.RowError`
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
