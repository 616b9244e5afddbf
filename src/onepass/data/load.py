"""Load conversations from anything a user points ``--data`` at, streaming.

Why this module exists: :mod:`onepass.conversation` reads one file. Real
corpora also arrive as a HF ``datasets`` directory (``save_to_disk``), a
folder of shards (``data/train-00000-of-00004.parquet``) or a hub id, and
large ones must stream: nothing here holds more than one record (or one
Arrow batch) at a time unless the format itself requires it (a ``.json``
array). Every record keeps its origin (``file line N`` / ``dir record N``)
so errors still name where the bad record is.

Specs understood by :func:`iter_conversation_records` and :func:`load_conversations`::

    chats.jsonl | chats.json | chats.parquet     one file (onepass.conversation.iter_records)
    path/to/dir                                  save_to_disk output, or a folder of data files
    builtin:mathchat                             the bundled MathChat sample
    synthetic:mathchat-sync                      the seeded synthetic workload (onepass.data.synthetic)
    owner/name                                   a hub dataset, streamed (only when online)

Example::

    >>> report = load_conversations("builtin:mathchat", limit=2)
    >>> [c.num_assistant_turns for c in report.conversations]
    [3, 3]

No torch here: this is pure data.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onepass.conversation import (
    Conversation,
    ConversationError,
    ReadReport,
    iter_records,
    parse_record,
)

DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRecord:
    """One record as stored, with where it came from. ``record`` is a ConversationError for a
    line that could not even be decoded (a lenient reader counts it)."""

    source: str
    index: int
    unit: str  # "line" (jsonl) or "record"
    record: Any

    def parse(self) -> Conversation:
        if isinstance(self.record, ConversationError):
            raise self.record
        return parse_record(self.record, source=self.source, index=self.index, unit=self.unit)


def hub_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _file_records(path: Path) -> Iterator[RawRecord]:
    unit = "line" if path.suffix.lower() in (".jsonl", ".ndjson") else "record"
    for index, record in iter_records(path):
        yield RawRecord(source=str(path), index=index, unit=unit, record=record)


def _arrow_rows(ds: Any, source: str) -> Iterator[RawRecord]:
    index = 0
    for batch in ds.iter(batch_size=512):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield RawRecord(source=source, index=index, unit="record", record=dict(zip(columns, values)))
            index += 1


def _saved_dataset(path: Path, split: str | None) -> Iterator[RawRecord]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) != 1 and "train" not in splits:
                raise ConversationError(f"{path}: a DatasetDict with splits {', '.join(splits)}; "
                                        "name one (split=... / --split)")
            split = splits[0] if len(splits) == 1 else "train"
        if split not in loaded:
            raise ConversationError(f"{path}: no split {split!r}; have {', '.join(splits)}")
        yield from _arrow_rows(loaded[split], f"{path} [{split}]")
    else:
        if split is not None:
            raise ConversationError(f"{path}: a single saved Dataset has no splits (got split={split!r})")
        yield from _arrow_rows(loaded, str(path))


def data_files(path: Path, split: str | None = None) -> list[Path]:
    """Data files under ``path`` (sorted, hidden ones ignored), optionally of one ``split``.

    A file belongs to a split when a folder on its relative path is named after
    it or its name starts with it (the hub's ``train-00000-of-00002.parquet``).
    """
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if split is not None:
        files = [p for p in files if split in p.relative_to(path).parts[:-1] or p.name.startswith(split)]
    return files


def _directory(path: Path, split: str | None) -> Iterator[RawRecord]:
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        yield from _saved_dataset(path, split)
        return
    files = data_files(path, split)
    if not files:
        what = f" for split {split!r}" if split else ""
        raise ConversationError(f"{path}: a directory with no data files{what} "
                                f"({', '.join(DATA_SUFFIXES)}) and not a saved HF dataset")
    for f in files:
        yield from _file_records(f)


def _hub(spec: str, split: str | None) -> Iterator[RawRecord]:
    import datasets

    ds = datasets.load_dataset(spec, split=split or "train", streaming=True)
    for index, row in enumerate(ds):
        yield RawRecord(source=f"hub:{spec} [{split or 'train'}]", index=index, unit="record", record=row)


def _synthetic(name: str) -> Iterator[RawRecord]:
    from onepass.data.synthetic import iter_workload

    for index, record in enumerate(iter_workload(name)):
        yield RawRecord(source=f"synthetic:{name}", index=index, unit="record", record=record)


def iter_conversation_records(spec: str | Path, *, split: str | None = None) -> Iterator[RawRecord]:
    """Stream the raw records of ``spec`` (see the module docstring), in order, with their origin."""
    text = str(spec)
    if text == "builtin:mathchat":
        from onepass.data.mathchat import sample_path

        yield from _file_records(sample_path())
        return
    if text.startswith("synthetic:"):
        yield from _synthetic(text.split(":", 1)[1])
        return
    if text.startswith("builtin:"):
        raise FileNotFoundError(f"unknown built-in data {text!r}; have builtin:mathchat, synthetic:NAME")
    path = Path(spec)
    if path.is_dir():
        yield from _directory(path, split)
    elif path.exists():
        if split is not None:
            raise ConversationError(f"{path}: split={split!r} only applies to a dataset directory or hub id")
        yield from _file_records(path)
    elif _HUB_ID.match(text) and not text.endswith(DATA_SUFFIXES):
        if hub_offline():
            raise FileNotFoundError(f"{text!r} is not a local file or directory, and the hub is offline "
                                    "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set): download it with "
                                    "datasets.load_dataset(...).save_to_disk(DIR) where you are online "
                                    "and pass DIR, or unset the variable")
        yield from _hub(text, split)
    else:
        raise FileNotFoundError(f"data file not found: {text} (a .jsonl/.json/.parquet file, a dataset "
                                "directory, builtin:mathchat, synthetic:NAME or a hub id owner/name)")


def iter_conversations(spec: str | Path, *, strict: bool = True, split: str | None = None,
                       skipped: list[str] | None = None) -> Iterator[Conversation]:
    """Stream validated conversations. A bad record raises (``strict``) or is appended to ``skipped``."""
    for raw in iter_conversation_records(spec, split=split):
        try:
            yield raw.parse()
        except ConversationError as e:
            if strict:
                raise
            if skipped is not None:
                skipped.append(str(e))


def load_conversations(spec: str | Path, *, strict: bool = True, limit: int | None = None,
                       split: str | None = None) -> ReadReport:
    """Read and validate ``spec`` like :func:`onepass.conversation.read_conversations`, for any spec.

    ``limit`` counts valid conversations; bad records are in ``ReadReport.skipped`` (never dropped
    silently) unless ``strict``, which raises on the first one.
    """
    report = ReadReport()
    if limit is not None and limit <= 0:
        return report
    for conv in iter_conversations(spec, strict=strict, split=split, skipped=report.skipped):
        report.conversations.append(conv)
        if limit is not None and len(report.conversations) >= limit:
            break
    return report


def to_record(conv: Conversation, **extra: Any) -> dict[str, Any]:
    """A :class:`Conversation` back to an OpenAI-style record that ``parse_record`` reads to the same
    conversation (reasoning as ``reasoning_content``, tool-call arguments as objects)."""
    record: dict[str, Any] = {}
    if conv.id is not None:
        record["id"] = conv.id
    record["messages"] = conv.template_messages()
    if conv.tools:
        record["tools"] = list(conv.tools)
    record.update(extra)
    return record


def write_records(records: Any, path: str | Path) -> int:
    """Write records as JSON lines atomically (a temporary file renamed when complete).

    Values JSON cannot hold (a parquet timestamp) are written as their ``str``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            n += 1
    os.replace(tmp, path)
    return n
