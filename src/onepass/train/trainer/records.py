"""The records a trainer is given, any of TRL's dataset types mixed, made into one-pass rows.

Why this module exists: ``OnePassTrainer`` takes every dataset ``SFTTrainer`` takes, record by record: a
conversation is rendered view by view into a tree (:mod:`onepass.train.trainer.data`), every other record is TRL's
row, a plain causal sequence tokenized and labelled as TRL does it (:mod:`onepass.train.core.sft_rows`). Sorting a
dataset's records by kind, packing them, and giving TRL's code the columns it looks for (``labels``,
``seq_lengths``) is one path, :func:`records_rows`, used whole by a map-style dataset (:func:`as_rows`) and a
batch at a time by a stream (:mod:`onepass.train.trainer.stream`), so the two make the same rows in the same order:

    records  [text, prompt-completion, conversation]
    rows     [conversation's tree] [text's row] [prompt-completion's row]   (conversations first, then TRL's rows)

Conversations under onepass's default loss (``assistant_only_loss`` None: their assistant turns, each in its
own context; SFTTrainer's default trains every token of one rendering) are said once, in one line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onepass.conversation.records import without_nulls
from onepass.errors import UsageError
from onepass.layout.pack import pack_layouts
from onepass.layout.share import merge_shared
from onepass.layout.tree import COLUMNS, Layout, concat, rows_to_columns
from onepass.prepare.config import DataConfig
from onepass.prepare.pipeline import PrepareStats
from onepass.train.core import sft_rows
from onepass.train.hf_config import OnePassConfig, warn_once
from onepass.train.trainer.data import (
    GuardInputs,
    PreparedRows,
    _columns,
    _formatted,
    _parse_conversations,
    prepare_units,
    rows_dataset,
)
from onepass.train.core.sft_rows import SftSettings

log = logging.getLogger("onepass")


def _settings(args: OnePassConfig, tokenizer: Any, packing: bool) -> Any:
    """TRL's tokenizing and labelling settings of ``args`` (:class:`onepass.train.core.sft_rows.SftSettings`)."""
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


CONVERSATION_LOSS = ("{source} holds conversations: OnePassTrainer trains their assistant turns, each in the context "
                     "the model sees at that turn (the per-turn loss, in one pass), where SFTTrainer by default "
                     "trains every token of one rendering, prompts included; set assistant_only_loss=False for "
                     "SFTTrainer's, or assistant_only_loss=True for onepass's (and no line)")


def _as_record(record: Any, args: OnePassConfig, formatting_func: Callable[[dict], Any] | None) -> Any:
    """A record as TRL reads it: through ``formatting_func`` (tokenized rows are not), ShareGPT turns as
    messages where ``assistant_only_loss=False`` asks for TRL's row of them."""
    if formatting_func is not None and not (isinstance(record, Mapping) and "input_ids" in record):
        record = _formatted(formatting_func, record, args.dataset_text_field)
    if isinstance(record, Mapping) and sft_rows.is_sharegpt(record) and args.assistant_only_loss is False:
        record = {**record, "messages": [{"role": m.get("from"), "content": m.get("value")}
                                         for m in record["conversations"]]}
    return record


def _is_conversation(record: Any, args: OnePassConfig) -> bool:
    """Rendered one-pass rather than made TRL's row: a conversation (unless ``assistant_only_loss=False`` asks
    for TRL's row of its messages), and anything that is not a mapping (``parse_record`` names what is wrong)."""
    if not isinstance(record, Mapping):
        return True
    kind = sft_rows.record_kind(record, args.dataset_text_field)
    return kind == sft_rows.MESSAGES and not (args.assistant_only_loss is False and "messages" in record)


def conversation_records(records: Iterable[tuple[int, Any]], args: OnePassConfig, *, source: str,
                         formatting_func: Callable[[dict], Any] | None = None) -> list[tuple[int, Any]]:
    """The records (each with its index) rendered one-pass, as :func:`as_rows` reads them (what a stream's
    guard looks at)."""
    records = [(i, _as_record(r, args, formatting_func)) for i, r in records]
    convs = [(i, r) for i, r in records if _is_conversation(r, args)]
    _say_conversation_loss(convs, args, source)
    return convs


def _say_conversation_loss(conversations: Sequence[Any], args: OnePassConfig, source: str) -> None:
    """One line, once, where conversations train onepass's default loss without it being asked for
    (``assistant_only_loss`` None): a script moved from SFTTrainer gets another objective otherwise unsaid."""
    if conversations and args.assistant_only_loss is None:
        warn_once("conversation_loss", CONVERSATION_LOSS.format(source=source))


@dataclass(frozen=True, kw_only=True)
class _Sorted:
    """A dataset's records by kind: conversations (one-pass) and TRL rows, each with its record index."""

    conversations: list[tuple[int, Any]]
    trl_rows: list[tuple[int, Any]]  # SftRow


def _records(ds: Any) -> Iterable[Any]:
    return ds if isinstance(ds, (list, tuple)) else (without_nulls(r) for r in ds)  # Arrow's nulls


def _sort_records(records: Iterable[tuple[int, Any]], tokenizer: Any, args: OnePassConfig, *, source: str,
                  formatting_func: Callable[[dict], Any] | None, packing: bool) -> _Sorted:
    """Each record as TRL's kind says: conversations stay records (rendered one-pass later); every other
    kind becomes TRL's row (:mod:`onepass.train.core.sft_rows`), truncated as TRL truncates it."""
    settings = None
    convs: list[tuple[int, Any]] = []
    rows: list[tuple[int, Any]] = []
    for i, record in records:
        record = _as_record(record, args, formatting_func)
        if _is_conversation(record, args):
            convs.append((i, record))
            continue
        settings = settings or _settings(args, tokenizer, packing)
        row = sft_rows.record_row(record, tokenizer, settings, where=f"{source} record {i}")
        if settings.truncate and not row.trained:
            continue  # TRL drops an example truncation left without a trained token
        rows.append((i, row))
    _say_conversation_loss(convs, args, source)
    return _Sorted(conversations=convs, trl_rows=rows)


@dataclass(frozen=True, kw_only=True)
class MadeRows:
    """Rows made of a dataset's records, with the columns TRL's code looks for: ``labels``
    (:func:`onepass.train.core.sft_rows.labels_view`; TRL's labels on TRL's rows) and, packed, ``seq_lengths``; the
    guard's inputs and the conversations' statistics (None: no conversation among the records)."""

    rows: list[Layout]
    labels: list[list[int]]
    seq_lengths: list[list[int]] | None = None  # packed rows only
    guard: GuardInputs | None = None
    stats: PrepareStats | None = field(default=None, repr=False)

    def extra(self) -> dict[str, list[list[int]]]:
        return {"labels": self.labels, **({} if self.seq_lengths is None else {"seq_lengths": self.seq_lengths})}

    def columns(self) -> dict[str, list[Any]]:
        """The rows as a batch of columns (a stream's; none is an empty batch)."""
        return {**(rows_to_columns(self.rows) if self.rows else {c: [] for c in COLUMNS}), **self.extra()}

    def prepared(self) -> PreparedRows:
        return PreparedRows(dataset=rows_dataset(self.rows, **self.extra()), guard=self.guard, stats=self.stats)


def as_rows(ds: Any, tokenizer: Any, args: OnePassConfig, *, source: str, packing: bool | None = None,
            formatting_func: Callable[[dict], Any] | None = None) -> PreparedRows:
    """What :class:`OnePassTrainer` trains on (a map-style dataset; a stream: :mod:`onepass.train.trainer.stream`):

    - one-pass rows (the five columns) pass through (no :class:`GuardInputs`);
    - every other dataset becomes :func:`records_rows` (with ``dataset_kwargs`` ``skip_prepare_dataset``:
      tokenized rows as they are, :func:`given_rows`).
    """
    packing = bool(args.packing if packing is None else packing)
    if ds is None or set(COLUMNS) <= set(_columns(ds)):
        return PreparedRows(dataset=ds)
    _check_custom_format(ds)
    columns = _columns(ds)
    if args.dataset_prepared:
        return given_rows(_records(ds), columns, source=source).prepared()
    check_preparable(columns, tokenizer, source=source, formatting_func=formatting_func)
    return records_rows(enumerate(_records(ds)), tokenizer, args, source=source, packing=packing,
                        formatting_func=formatting_func).prepared()


def check_preparable(columns: Sequence[str], tokenizer: Any, *, source: str,
                     formatting_func: Callable[[dict], Any] | None) -> None:
    """Records with these columns can be prepared: a tokenizer that renders (but for tokenized rows)."""
    if "input_ids" in columns and formatting_func is not None:
        log.warning("onepass: %s is tokenized already (an input_ids column): formatting_func is ignored", source)
    if (tokenizer is None or not hasattr(tokenizer, "apply_chat_template")) and "input_ids" not in columns:
        raise UsageError(f"{source} holds conversations: pass processing_class=tokenizer to render them")


def records_rows(records: Iterable[tuple[int, Any]], tokenizer: Any, args: OnePassConfig, *, source: str,
                 packing: bool, formatting_func: Callable[[dict], Any] | None = None, part: bool = False) -> MadeRows:
    """The rows of ``records`` (each with its index in the dataset), any of TRL's dataset types mixed:

    - conversations (a ``messages``, ``conversations`` or ``interactions`` column, ShareGPT records, ...)
      become :func:`prepare_rows` items with ``args.data_config``, each record's ``chat_template_kwargs``
      over the run's ``template_kwargs``;
    - every other record of TRL's dataset types (text, prompt-completion, tokenized ``input_ids``; and
      conversations under ``assistant_only_loss=False``) becomes TRL's row, a plain causal sequence
      (:mod:`onepass.train.core.sft_rows`).

    ``part``: the records are one batch of a stream (read in order, shuffled as a stream is): a batch with
    nothing trainable is logged, not an error, and packing packs within the batch.
    """
    sorted_ = _sort_records(records, tokenizer, args, source=source, formatting_func=formatting_func,
                            packing=packing)
    order = [i for i, _ in sorted_.conversations] + [i for i, _ in sorted_.trl_rows]
    if args.shuffle_dataset and not part:
        import random

        random.Random(args.seed).shuffle(order)
    position = {i: k for k, i in enumerate(order)}
    conversations = sorted(sorted_.conversations, key=lambda x: position[x[0]])
    trl_rows = [r for _, r in sorted(sorted_.trl_rows, key=lambda x: position[x[0]])]
    return _rows_of(conversations, trl_rows, tokenizer, args, source=source, packing=packing, part=part)


def _check_custom_format(ds: Any) -> None:
    fmt = getattr(ds, "format", None)
    if isinstance(fmt, Mapping) and fmt.get("type") == "custom":
        raise ValueError("OnePassTrainer cannot prepare a dataset that uses `Dataset.with_transform()` (as "
                         "SFTTrainer): preparing reads through the transform and would bake a random or stateful "
                         "transform into the rows. Pass dataset_kwargs={'skip_prepare_dataset': True} and make the "
                         "transform return trainer-ready examples (one-pass rows, or input_ids and labels), or "
                         "materialize a deterministic transform with Dataset.map() first")


def given_rows(records: Iterable[Any], columns: Sequence[str], *, source: str) -> MadeRows:
    """``skip_prepare_dataset`` with tokenized rows: each ``input_ids`` (with its ``labels``, or every token
    trained) one causal row as it is, untruncated, as TRL's collator takes it."""
    if "input_ids" not in columns:
        raise UsageError(f"{source}: dataset_kwargs skip_prepare_dataset=True needs one-pass rows "
                         f"({', '.join(COLUMNS)}) or tokenized rows (input_ids, labels), got columns "
                         f"{', '.join(columns)}")
    if "labels" not in columns and any(c in columns for c in sft_rows.MASK_COLUMNS):
        raise ValueError(f"The {source} dataset has mask columns but no 'labels', and `skip_prepare_dataset=True` "
                         "skips label building, so it would train on the full sequence. Add a 'labels' column "
                         "(-100 for non-loss tokens) or drop `skip_prepare_dataset`.")
    rows = [sft_rows.given_row(r, where=f"{source} record {i}") for i, r in enumerate(records)]
    return MadeRows(rows=[sft_rows.causal_layout(r) for r in rows], labels=[list(r.labels) for r in rows])


def _rows_of(conversations: Sequence[tuple[int, Any]], trl_rows: Sequence[Any], tokenizer: Any,
             args: OnePassConfig, *, source: str, packing: bool, part: bool = False) -> MadeRows:
    """The one-pass rows: the conversations' trees (grouped by their records' ``chat_template_kwargs``, each
    group rendered with them) and TRL's rows; packed when ``packing``. ``part``: see :func:`records_rows`."""
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
            convs = _parse_conversations([r for _, r in group], source=source, required=not part)
            if not convs:
                continue
            out = prepare_units(convs, tokenizer, config, num_proc=None if part else args.dataset_num_proc,
                                progress=not (part or args.disable_tqdm), required=not part)
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
        trees = _shared(units, args.data_config, args.max_length)
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
    if not kept and not part:
        raise ValueError(f"no trainable rows in {source}")
    rows = [rows[k] for k in kept]
    labels = [labels[k] for k in kept] if labels is not None else [list(sft_rows.labels_view(r)) for r in rows]
    return MadeRows(rows=rows, labels=labels, seq_lengths=[sft_rows.seq_lengths(r) for r in rows] if packing else None,
                    guard=guard, stats=stats)


def _shared(units: Sequence[Sequence[Layout]], data_config: DataConfig, max_tokens: int) -> list[Layout]:
    """The conversations' trees to pack: with ``share_prefix`` (under every schedule but n-pass), trees of
    conversations that share a token prefix merged into one tree (:func:`onepass.layout.share.merge_shared`,
    the code ``prepare --pack`` and :func:`~onepass.train.trainer.data.prepare_rows` pack with), each tree alone
    otherwise. A stream shares within each batch it packs (:mod:`onepass.train.trainer.stream`)."""
    trees = [tree for unit in units for tree in unit]
    packed = data_config.replace(pack=True, max_tokens=max_tokens)
    if not packed.shares or len(trees) < 2:
        return trees
    merged = merge_shared(trees, [u for u, unit in enumerate(units) for _ in unit], max_tokens,
                          window=packed.share_window)
    if len(merged) < len(trees):
        log.info("onepass: shared prefixes: %d trees merged into %d across conversations, %d tokens fewer",
                 len(trees), len(merged), sum(map(len, trees)) - sum(len(m.layout) for m in merged))
    return [m.layout for m in merged]


def _cut(args: OnePassConfig) -> Any:
    return SftSettings(max_length=args.max_length, truncation_mode="keep_start", truncate=True)
