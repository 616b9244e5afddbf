"""Prepare at scale: render and tokenise with ``datasets.map(num_proc=...)``, same result as serial.

Why this module exists: rendering every view with a Jinja chat template and
tokenising it is pure Python per conversation, so one core does ~70
conversations a second; a 145k-conversation corpus wants every core. This
shards the conversations over ``num_proc`` processes with HF ``datasets``
(records stream into an Arrow file in a temporary folder, never all in
memory), runs :func:`onepass.prepare.prepare` on each conversation in the
workers (unpacked), and merges in input order: layouts, then packing and the
final counts exactly as ``prepare`` does them. The rows and
:class:`~onepass.prepare.PrepareStats` equal the serial pipeline's
(``tests/test_data_parallel.py``), including every skip and its reason.

Serial reference it matches::

    report = load_conversations(spec, strict=strict, limit=limit)
    stats = PrepareStats()
    for line in report.skipped:
        stats.skip("invalid record", line)
    rows, stats = prepare(report.conversations, tokenizer, config, stats=stats, strict=strict)

Example::

    rows, stats = prepare_parallel("chats.jsonl", "builtin:qwen3", PrepareConfig(), num_proc=8)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onepass.conversation import ConversationError, parse_record

from onepass.prepare import PrepareConfig, PrepareStats, finalize, prepare
from onepass.tree import COLUMNS, ROW_SCHEMA, Layout, row_from_columns

ADDITIVE = ("conversations", "conversations_used", "views", "views_trained", "views_skipped",
            "boundary_merge_views", "n_pass_tokens", "one_pass_tokens", "scheduled_tokens", "target_tokens")
_TOKENIZERS: dict[tuple[str, str | None], Any] = {}  # per worker process


def _records(spec: str, split: str | None, limit: int | None, strict: bool) -> Iterator[dict[str, Any]]:
    """Raw records as JSON text with their origin; invalid ones carry their error instead."""
    from onepass.data.load import iter_conversation_records

    valid = 0
    for raw in iter_conversation_records(spec, split=split):
        if limit is not None and valid >= limit:
            return
        error = None
        try:
            raw.parse()
            valid += 1
        except ConversationError as e:
            if strict:
                raise
            error = str(e)
        yield {"source": raw.source, "index": raw.index, "unit": raw.unit, "error": error,
               "record": None if error else json.dumps(raw.record, ensure_ascii=False, default=str)}


def _tokenizer(tokenizer: Any, chat_template: str | None) -> Any:
    if not isinstance(tokenizer, str):
        return tokenizer
    key = (tokenizer, chat_template)
    if key not in _TOKENIZERS:
        from onepass.tokenizer import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(tokenizer, chat_template=chat_template)
    return _TOKENIZERS[key]


def _prepare_batch(batch: dict[str, list], *, tokenizer: Any, chat_template: str | None,
                   config: PrepareConfig, strict: bool) -> dict[str, list]:
    """Worker: one output row per input record (its layouts as nested lists, its counts as JSON)."""
    tok = _tokenizer(tokenizer, chat_template)
    out: dict[str, list] = {c: [] for c in (*COLUMNS, "stats")}
    for source, index, unit, record, error in zip(batch["source"], batch["index"], batch["unit"],
                                                   batch["record"], batch["error"]):
        layouts: list[Layout] = []
        if error is not None:
            info: dict[str, Any] = {"invalid": error}
        else:
            conv = parse_record(json.loads(record), source=source, index=index, unit=unit)
            layouts, st = prepare([conv], tok, config, strict=strict)
            assert len(st.skipped_by_reason) <= 1, st.skipped_by_reason  # one conversation, one kind of skip
            reason = next(iter(st.skipped_by_reason), "")
            info = {k: getattr(st, k) for k in ADDITIVE} | {"skipped": st.skipped, "reason": reason}
        for c in COLUMNS:
            out[c].append([getattr(x, c).tolist() for x in layouts])
        out["stats"].append(json.dumps(info))
    return out


def _features() -> Any:
    import datasets

    rows = {c: datasets.List(datasets.List(datasets.Value(dtype.name))) for c, dtype in ROW_SCHEMA.items()}
    return datasets.Features({**rows, "stats": datasets.Value("string")})


def _record_features() -> Any:
    import datasets

    s = datasets.Value("string")
    return datasets.Features({"source": s, "index": datasets.Value("int64"), "unit": s, "error": s, "record": s})


def prepare_parallel(spec: str | Path, tokenizer: Any, config: PrepareConfig = PrepareConfig(), *,
                     num_proc: int = 2, chat_template: str | None = None, split: str | None = None,
                     limit: int | None = None, strict: bool = False, batch_size: int = 8,
                     progress: bool = False) -> tuple[list[Layout], PrepareStats]:
    """Rows and stats of ``spec`` (any :mod:`onepass.data.load` spec) prepared on ``num_proc`` processes.

    ``tokenizer`` is a spec (``builtin:qwen3``, a path; each worker loads it once) or a loaded
    tokenizer (pickled to each worker). ``limit`` counts valid conversations, as the serial reader.
    """
    import datasets
    from datasets.exceptions import DatasetGenerationError

    from onepass.schedule import parse_schedule

    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    stats = PrepareStats(schedule=str(parse_schedule(config.schedule)), weighting=config.weighting,
                         max_tokens=config.max_tokens, packed=config.pack)
    if limit is not None and limit <= 0:
        return finalize([], stats, config)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="onepass-prepare-") as tmp:
            try:
                records = datasets.Dataset.from_generator(
                    _records, features=_record_features(), cache_dir=tmp, fingerprint=uuid.uuid4().hex,
                    gen_kwargs={"spec": str(spec), "split": split, "limit": limit, "strict": strict})
            except DatasetGenerationError as e:
                cause = e.__cause__
                raise cause if isinstance(cause, (ConversationError, FileNotFoundError)) else e from None
            if len(records) == 0:
                return finalize([], stats, config)
            fn_kwargs = {"tokenizer": tokenizer, "chat_template": chat_template, "strict": strict,
                         "config": dataclasses.replace(config, pack=False)}
            done = records.map(_prepare_batch, batched=True, batch_size=batch_size, fn_kwargs=fn_kwargs,
                               num_proc=min(num_proc, len(records)) if num_proc > 1 else None,
                               remove_columns=records.column_names, features=_features(),
                               load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex, desc="prepare")
            layouts, skips = _merge(done, stats)
    finally:
        if bars:
            datasets.enable_progress_bars()
    for reason, message in skips:
        stats.skip(reason, message)
    return finalize(layouts, stats, config)


def _merge(done: Any, stats: PrepareStats) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Layouts in input order; invalid-record skips go straight into ``stats`` (the serial reader
    reports them first), the others are returned in order."""
    layouts: list[Layout] = []
    skips: list[tuple[str, str]] = []
    for batch in done.iter(batch_size=256):
        for i, text in enumerate(batch["stats"]):
            info = json.loads(text)
            if "invalid" in info:
                stats.skip("invalid record", info["invalid"])
                continue
            for k in ADDITIVE:
                setattr(stats, k, getattr(stats, k) + info[k])
            skips.extend((info["reason"], m) for m in info["skipped"])
            for arrays in zip(*(batch[c][i] for c in COLUMNS)):
                layouts.append(row_from_columns(dict(zip(COLUMNS, arrays))))
    return layouts, skips
