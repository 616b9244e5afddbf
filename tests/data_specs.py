"""Every kind of ``--data`` spec, written to a folder: tests run each kind through each command.

A spec of conversations holds :data:`RECORDS` (three small two-turn conversations, so
``--limit 2`` is a real cut) in the form its kind names; ``builtin:`` and ``synthetic:``
are what they are. :func:`write_prepared` makes the rows ``onepass prepare`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

A = {"id": "a", "messages": [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "add"},
                             {"role": "user", "content": "and 3+3?"},
                             {"role": "assistant", "content": "6", "reasoning_content": ""}]}
B = {"id": "b", "messages": [{"role": "user", "content": "name a prime"},
                             {"role": "assistant", "content": "7", "reasoning_content": "small"},
                             {"role": "user", "content": "another?"},
                             {"role": "assistant", "content": "11", "reasoning_content": "next"}]}
RECORDS = [A, B, dict(A, id="c")]

CONVERSATION_KINDS = ("jsonl", "json", "parquet", "folder", "saved", "builtin", "synthetic")
SPEC_KINDS = (*CONVERSATION_KINDS, "rows")


def write_record_file(path: Path, records: list[dict]) -> Path:
    """``records`` as .jsonl, .json or .parquet, by the suffix of ``path``."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_spec(kind: str, folder: Path) -> str:
    """A ``--data`` spec of conversations of ``kind`` (one of :data:`CONVERSATION_KINDS`) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind in ("jsonl", "json", "parquet"):
        return str(write_record_file(folder / f"chats.{kind}", RECORDS))
    if kind == "folder":
        (folder / "shards").mkdir()
        write_record_file(folder / "shards" / "part-0.jsonl", RECORDS[:2])
        write_record_file(folder / "shards" / "part-1.jsonl", RECORDS[2:])
        return str(folder / "shards")
    if kind == "saved":
        import datasets

        datasets.Dataset.from_list(RECORDS).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    if kind == "builtin":
        return "builtin:mathchat"
    assert kind == "synthetic", kind
    return "synthetic:mathchat-sync"


def write_prepared(folder: Path) -> str:
    """Rows of :data:`RECORDS` as ``onepass prepare --out`` writes them (builtin:qwen3)."""
    from onepass.cli import main

    spec = write_spec("jsonl", folder / "source")
    out = folder / "prepared"
    assert main(["prepare", "--data", spec, "--out", str(out), "--no-progress"]) == 0
    return str(out)
