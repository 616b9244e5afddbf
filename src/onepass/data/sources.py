"""Load conversations from anything a user points ``--data`` at, streaming.

Why this module exists: :mod:`onepass.conversation.parse` reads one file. Real
corpora also arrive as a HF ``datasets`` directory (``save_to_disk``), a
folder of shards (``data/train-00000-of-00004.parquet``) or a hub id, and
large ones must stream: nothing here holds more than one record (or one
Arrow batch) at a time unless the format itself requires it (a ``.json``
array). Every record keeps its origin (``file line N`` / ``dir record N``)
so errors still name where the bad record is.

It is also the one place that says what a ``--data`` spec names
(:func:`resolve_data`), for every command (prepare, verify, show, train, bench,
data ...), so a spec one command accepts, all accept::

    chats.jsonl | chats.json | chats.parquet     conversations: one file (onepass.conversation.records.iter_records)
    path/to/dir                                  conversations: a folder of data files, or a saved dataset
                                                 (save_to_disk) with a messages/conversations/interactions column
    path/to/prepared                             prepared rows: a saved dataset with the row columns
                                                 (onepass prepare --out; only onepass train takes them)
    builtin:mathchat                             conversations: the bundled MathChat sample
    synthetic:mathchat-sync                      conversations: the seeded synthetic workload (onepass.data.synthetic)
    owner/name                                   conversations: a hub dataset, streamed (only when online)

Anything else is one :class:`~onepass.errors.DataError` line naming what was found.

Example::

    >>> resolve_data("builtin:mathchat").kind
    'conversations'
    >>> report = load_conversations("builtin:mathchat", limit=2)
    >>> [c.num_assistant_turns for c in report.conversations]
    [3, 3]

No torch here: this is pure data.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onepass.conversation.parse import Conversation, ReadReport, parse_record
from onepass.data.mathchat import sample_path
from onepass.data.synthetic import iter_workload, workload_names
from onepass.errors import ConversationError, DataError, DataNotFound
from onepass.files import atomic_file
from onepass.hub import hub_offline, offline_reason
from onepass.conversation.records import iter_records, without_nulls
from onepass.render.messages import template_messages
from onepass.layout.tree import COLUMNS

DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
CONVERSATION_COLUMNS = ("messages", "conversations", "interactions")
TRL_COLUMNS = (("prompt", "completion"), ("text",), ("input_ids",))
"""The columns of TRL's other dataset types (prompt-completion, text, tokenized): ``onepass train`` reads a saved
dataset of them as records (:func:`resolve_data`'s ``trl_records``) and trains them as TRL's rows."""
CONVERSATIONS, ROWS = "conversations", "rows"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DATA_HELP = ("conversations: .jsonl/.json/.parquet, a folder of them, a saved dataset, builtin:mathchat, "
             "synthetic:NAME or a hub id (online only)")  # --data's help, in every command that reads conversations


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


def _file_records(path: Path) -> Iterator[RawRecord]:
    unit = "line" if path.suffix.lower() in (".jsonl", ".ndjson") else "record"
    for index, record in iter_records(path):
        yield RawRecord(source=str(path), index=index, unit=unit, record=record)


def _arrow_rows(ds: Any, source: str) -> Iterator[RawRecord]:
    index = 0
    for batch in ds.iter(batch_size=512):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            record = without_nulls(dict(zip(columns, values)))  # Arrow's null-filled struct keys
            yield RawRecord(source=source, index=index, unit="record", record=record)
            index += 1


def _saved_dataset(source: DataSource) -> Iterator[RawRecord]:
    import datasets

    loaded = datasets.load_from_disk(str(source.path))
    if isinstance(loaded, datasets.DatasetDict):
        yield from _arrow_rows(loaded[source.split], f"{source.path} [{source.split}]")
    else:
        yield from _arrow_rows(loaded, str(source.path))


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


def _hub(spec: str, split: str | None) -> Iterator[RawRecord]:
    import datasets

    ds = datasets.load_dataset(spec, split=split or "train", streaming=True)
    for index, row in enumerate(ds):
        yield RawRecord(source=f"hub:{spec} [{split or 'train'}]", index=index, unit="record",
                        record=without_nulls(row))  # Arrow-typed as a saved dataset


def _synthetic(name: str) -> Iterator[RawRecord]:
    for index, record in enumerate(iter_workload(name)):
        yield RawRecord(source=f"synthetic:{name}", index=index, unit="record", record=record)


# ---------------------------------------------------------------------------------------------
# what a spec names


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSource:
    """What a ``--data`` spec names, found without reading the data (:func:`resolve_data`).

    ``kind``: ``"conversations"`` (prepared on the fly by every command) or ``"rows"`` (a
    folder written by ``onepass prepare``; only ``onepass train`` takes those). ``form``: how
    the records are read: file, folder (of data files), saved (``save_to_disk``), builtin,
    synthetic or hub. ``description`` is what an error or a log line calls it.
    """

    spec: str
    kind: str
    form: str
    description: str
    path: Path | None = None
    split: str | None = None


def _saved_columns(folder: Path) -> list[str]:
    """Column names of one saved ``Dataset``, from its ``dataset_info.json`` (no data read)."""
    try:
        features = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))["features"]
        if isinstance(features, dict) and features:
            return [str(c) for c in features]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    import datasets  # no usable dataset_info.json: open it (memory-mapped, still no rows read)

    try:
        return list(datasets.load_from_disk(str(folder)).column_names)
    except (OSError, ValueError) as e:
        raise DataError(f"{folder}: a saved dataset that cannot be opened ({e})") from None


def _kind_of(columns: list[str], where: str, trl_records: bool = False) -> str:
    if set(COLUMNS) <= set(columns):
        return ROWS
    if any(c in columns for c in CONVERSATION_COLUMNS) or {"input", "output"} <= set(columns):
        return CONVERSATIONS  # input/output: Llama-Nemotron pairs (onepass.conversation.parse reads them)
    if trl_records and any(set(c) <= set(columns) for c in TRL_COLUMNS):
        return CONVERSATIONS  # records of TRL's other types: onepass train trains them as TRL's rows
    raise DataError(f"{where} has columns {', '.join(columns) or '(none)'}: neither conversations (a "
                    f"{', '.join(CONVERSATION_COLUMNS)} column) nor prepared rows ({', '.join(COLUMNS)})")


def _resolve_saved(spec: str, path: Path, split: str | None, trl_records: bool = False) -> DataSource:
    folder, where = path, f"saved dataset {path}"
    if (path / "dataset_dict.json").is_file():
        try:
            splits = [str(s) for s in json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        if split is None:
            if len(splits) != 1 and "train" not in splits:
                raise DataError(f"{path}: a DatasetDict with splits {', '.join(splits)}; name one (--split)")
            split = splits[0] if len(splits) == 1 else "train"
        if split not in splits:
            raise DataError(f"{path}: no split {split!r}; have {', '.join(splits)}")
        folder, where = path / split, f"saved dataset {path} [{split}]"
    elif split is not None:
        raise DataError(f"{path}: a single saved Dataset has no splits (got split={split!r})")
    kind = _kind_of(_saved_columns(folder), where, trl_records)
    if kind == ROWS and folder != path:
        raise DataError(f"{where} holds prepared rows inside a DatasetDict; pass the split's folder {folder}")
    what = "prepared rows" if kind == ROWS else "conversations"
    return DataSource(spec=spec, kind=kind, form="saved", path=path, split=split, description=f"{where} ({what})")


def _resolve_folder(spec: str, path: Path, split: str | None, trl_records: bool = False) -> DataSource:
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _resolve_saved(spec, path, split, trl_records)
    files = data_files(path, split)
    if not files:
        what = f" for split {split!r}" if split else ""
        raise DataError(f"folder {path} has no data files{what} ({', '.join(DATA_SUFFIXES)}) and is not "
                        "a saved dataset (save_to_disk)")
    return DataSource(spec=spec, kind=CONVERSATIONS, form="folder", path=path, split=split,
                      description=f"folder {path} ({len(files)} data file{'s' * (len(files) != 1)})")


def resolve_data(spec: str | Path, *, split: str | None = None, trl_records: bool = False) -> DataSource:
    """What ``spec`` names (see the module docstring), or one :class:`DataError` line saying what was found.

    Cheap: a saved dataset is recognised by the columns in its ``dataset_info.json``, a
    folder by its file names; nothing is read. A hub id is taken on trust (online only).
    ``trl_records`` (``onepass train``, which trains them): a saved dataset of TRL's other types
    (:data:`TRL_COLUMNS`) is a source of records too; every other command refuses it by its columns.
    """
    text = str(spec)
    if text == "builtin:mathchat":
        return DataSource(spec=text, kind=CONVERSATIONS, form="builtin", path=sample_path(),
                          description="builtin:mathchat (the bundled MathChat sample)")
    if text.startswith("synthetic:"):
        name = text.split(":", 1)[1]
        if name not in workload_names():
            raise DataNotFound(f"unknown synthetic workload {name!r}; have {', '.join(workload_names())}")
        return DataSource(spec=text, kind=CONVERSATIONS, form="synthetic",
                          description=f"{text} (seeded synthetic conversations)")
    if text.startswith("builtin:"):
        raise DataNotFound(f"unknown built-in data {text!r}; have builtin:mathchat, synthetic:NAME")
    path = Path(spec)
    if path.is_dir():
        return _resolve_folder(text, path, split, trl_records)
    if path.exists():
        if split is not None:
            raise DataError(f"{path}: split={split!r} only applies to a dataset directory or hub id")
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise DataError(f"{path}: unsupported file type {path.suffix.lower() or '(none)'!r}; "
                            f"use {', '.join(DATA_SUFFIXES)}, a folder of them or a saved dataset")
        return DataSource(spec=text, kind=CONVERSATIONS, form="file", path=path, description=f"file {path}")
    if _HUB_ID.match(text) and not text.endswith(DATA_SUFFIXES):
        if hub_offline("datasets"):
            raise DataNotFound(f"{text!r} is not a local file or directory, and the hub is offline "
                               f"({offline_reason('datasets')}): download it with "
                               "datasets.load_dataset(...).save_to_disk(DIR) where you are online "
                               "and pass DIR, or unset the variable")
        return DataSource(spec=text, kind=CONVERSATIONS, form="hub", split=split,
                          description=f"hub dataset {text} [{split or 'train'}]")
    raise DataNotFound(f"data file not found: {text} (a .jsonl/.json/.parquet file, a folder of them, a saved "
                       "dataset, builtin:mathchat, synthetic:NAME or a hub id owner/name)")


def conversation_source(spec: str | Path | DataSource, *, split: str | None = None) -> DataSource:
    """:func:`resolve_data`, refusing prepared rows with one line (every command but train needs conversations)."""
    source = spec if isinstance(spec, DataSource) else resolve_data(spec, split=split)
    if source.kind != CONVERSATIONS:
        raise DataError(f"{source.description}: prepared rows (written by onepass prepare), not conversations; "
                        "this command needs conversations (onepass train takes prepared rows)")
    return source


def iter_conversation_records(spec: str | Path | DataSource, *, split: str | None = None) -> Iterator[RawRecord]:
    """Stream the raw records of ``spec`` (see the module docstring), in order, with their origin."""
    source = conversation_source(spec, split=split)
    if source.form in ("file", "builtin"):
        assert source.path is not None
        yield from _file_records(source.path)
    elif source.form == "synthetic":
        yield from _synthetic(source.spec.split(":", 1)[1])
    elif source.form == "folder":
        assert source.path is not None
        for f in data_files(source.path, source.split):
            yield from _file_records(f)
    elif source.form == "saved":
        yield from _saved_dataset(source)
    else:
        assert source.form == "hub", source.form
        yield from _hub(source.spec, source.split)


def iter_conversations(spec: str | Path | DataSource, *, strict: bool = True, split: str | None = None,
                       skipped: list[str] | None = None) -> Iterator[Conversation]:
    """Stream validated conversations. A bad record raises (``strict``) or is appended to ``skipped``."""
    yield from parse_records(iter_conversation_records(spec, split=split), strict=strict, skipped=skipped)


def parse_records(raws: Iterable[RawRecord], *, strict: bool = True,
                  skipped: list[str] | None = None) -> Iterator[Conversation]:
    """Validated conversations of raw records (any source: a spec's files, an in-memory dataset).
    A bad record raises (``strict``) or is appended to ``skipped``."""
    for raw in raws:
        try:
            yield raw.parse()
        except ConversationError as e:
            if strict:
                raise
            if skipped is not None:
                skipped.append(str(e))


def limit_arg(text: str) -> int:
    """``--limit N`` of every command: an integer >= 1 (0 or a negative number would read nothing and end in
    "every conversation was skipped", blaming the data), as an argparse ``type``.

    >>> limit_arg("8")
    8
    """
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number of conversations, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (a number of conversations), got {n}")
    return n


def load_conversations(spec: str | Path | DataSource, *, strict: bool = True, limit: int | None = None,
                       split: str | None = None) -> ReadReport:
    """Read and validate ``spec`` like :func:`onepass.conversation.parse.read_conversations`, for any spec.

    ``limit`` counts valid conversations; bad records are in ``ReadReport.skipped`` (never dropped
    silently) unless ``strict``, which raises on the first one.
    """
    report = ReadReport()
    if limit is not None and limit <= 0:
        return report
    conversations = iter_conversations(spec, strict=strict, split=split, skipped=report.skipped)
    for conv in conversations:
        report.conversations.append(conv)
        if limit is not None and len(report.conversations) >= limit:
            seen = len(report.skipped)
            try:  # is a valid conversation left? (``more``: a command says the limit cut the data)
                report.more = next(conversations, None) is not None
            except ConversationError:  # strict: a bad record past the limit is not this read's error
                report.more = True
            del report.skipped[seen:]  # records past the limit are not this read's skips
            break
    return report


def print_skipped(skipped: Sequence[str], what: str = "records") -> None:
    """The first five of a reader's skip lines on stderr, then how many more (never dropped silently)."""
    for line in skipped[:5]:
        print(f"skipped: {line}", file=sys.stderr)
    if len(skipped) > 5:
        print(f"... and {len(skipped) - 5} more skipped {what}", file=sys.stderr)


def to_record(conv: Conversation, **extra: Any) -> dict[str, Any]:
    """A :class:`Conversation` back to an OpenAI-style record that ``parse_record`` reads to the same
    conversation (reasoning as ``reasoning_content``, or the leading ``<think>`` block and tool-call arguments as
    the record gave them; an assistant message's OpenAI ``weight`` as the record marked it: 0, not trained, or 1,
    marked for ``--train-turns weight``)."""
    record: dict[str, Any] = {}
    if conv.id is not None:
        record["id"] = conv.id
    messages = template_messages(conv, verbatim_arguments=True, inline_reasoning=True)  # as the record gave them
    head = len(messages) - len(conv.messages)  # the system prompt
    for m, out in zip(conv.messages, messages[head:]):
        if m.role == "assistant" and (not m.train or m.marked):
            out["weight"] = int(m.train)
    for k in conv.tool_changes:  # a message's own tool list (never a template's message field)
        messages[head + k]["tools"] = list(conv.messages[k].tools or ())
    record["messages"] = messages
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
    n = 0
    with atomic_file(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            n += 1
    return n
