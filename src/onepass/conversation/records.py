"""Record files: ``.jsonl`` (streamed line by line), ``.json`` and ``.parquet``, one raw record at a time.

Why this module exists: reading bytes into records is where a file can be
broken (a line that is not UTF-8 or not JSON) before any record is parsed;
each such line becomes one :class:`~onepass.errors.ConversationError` value
naming the file and line, so a lenient reader counts it and goes on.
:mod:`onepass.conversation.parse` parses the records; :mod:`onepass.data.sources`
reads every other kind of ``--data`` (folders, saved datasets, hub ids).

Arrow (parquet, ``save_to_disk``, the hub) stores a column of objects as one struct type: every
record's tool-call ``arguments`` and tool ``parameters`` get every key any record has, ``null``
where it had none. Read back, ``{"city": "Paris"}`` would be ``{"city": "Paris", "expr": None}``
and train as such. :func:`without_nulls` drops every null-valued key of a record read from Arrow,
so a parquet or saved copy of a JSONL file gives the same conversation (a key whose value was a
real JSON ``null`` cannot be told apart in Arrow and is dropped too; every reader of onepass takes
a null field as absent). Arrow also stores a struct's keys in one order for the whole column:
arguments whose keys come in another order per record keep it only as JSON strings.

No torch here: this is pure data.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from onepass.errors import ConversationError, DataNotFound


class DuplicateKey(ValueError):
    """A JSON object that names one key twice: Python's parser keeps the last value and drops the first."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` refusing a key written twice in one object (``{"content": "a", "content": "b"}``
    would train "b" and drop "a" without a word).

    >>> json.loads('{"a": 1, "a": 2}', object_pairs_hook=unique_keys)
    Traceback (most recent call last):
    ...
    onepass.conversation.records.DuplicateKey: key 'a' appears twice in one object (JSON keeps only the last)
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"key {twice!r} appears twice in one object (JSON keeps only the last)")
    return out


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of every nested object dropped (list items are kept).

    >>> without_nulls({"a": 1, "b": None, "c": [{"d": None, "e": 2}, None]})
    {'a': 1, 'c': [{'e': 2}, None]}
    """
    if isinstance(value, Mapping):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def iter_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(record_index, raw_record)`` from .jsonl, .json or .parquet, streaming where possible.

    A .jsonl line that is not valid JSON is yielded as a :class:`ConversationError`
    value (not raised), so a lenient reader can count it and go on.
    """
    path = Path(path)
    if not path.exists():
        raise DataNotFound(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open("rb") as f:  # decoded line by line: one bad line is one skip, not the end of the file
            for lineno, data in enumerate(f, start=1):
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, ConversationError(f"{path} line {lineno}: not valid UTF-8 "
                                                    f"(byte 0x{data[e.start]:02x} at byte {e.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line, object_pairs_hook=unique_keys)
                except json.JSONDecodeError as e:
                    record = ConversationError(f"{path} line {lineno}: not valid JSON ({e.msg})")
                except DuplicateKey as e:
                    record = ConversationError(f"{path} line {lineno}: {e}")
                except RecursionError:  # a record nested thousands deep: one skip, not the end of the run
                    record = ConversationError(f"{path} line {lineno}: JSON nested too deeply to read")
                yield lineno, record
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise ConversationError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except DuplicateKey as e:
            raise ConversationError(f"{path}: {e}") from None
        except RecursionError:
            raise ConversationError(f"{path}: JSON nested too deeply to read") from None
        if isinstance(data, Mapping):
            data = [data]
        if not isinstance(data, list):
            raise ConversationError(f"{path}: expected a list of records or one record")
        yield from enumerate(data)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield index, without_nulls(row)
                index += 1
    else:
        raise ConversationError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
