"""Loading any --data spec: files in every shape, HF dataset directories, hub ids offline, streaming;
what a spec names (conversations or prepared rows) without reading it, and one line for anything else."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from data_specs import RECORDS, write_prepared, write_record_file, write_spec

from onepass.conversation.parse import ConversationError, parse_record
from onepass.data.sources import (
    data_files,
    iter_conversation_records,
    load_conversations,
    resolve_data,
    to_record,
    write_records,
)
from onepass.errors import DataError, DataNotFound

MESSAGES = {"id": "m1", "messages": [{"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                                     {"role": "user", "content": "and 3+3?"},
                                     {"role": "assistant", "content": "6", "reasoning_content": ""}]}
SHAREGPT = {"id": "s1", "conversations": [{"from": "human", "value": "2+2?"},
                                          {"from": "gpt", "value": "4", "reasoning": "add"},
                                          {"from": "human", "value": "and 3+3?"},
                                          {"from": "gpt", "value": "6", "reasoning": ""}]}
INTERACTIONS = {"id": "i1", "interactions": [{"query": "2+2?", "think": "add", "answer": "4"},
                                             {"query": "and 3+3?", "think": "", "answer": "6"}]}
SHAPES = [MESSAGES, SHAREGPT, INTERACTIONS]


def _strip(conv):
    return dataclasses.replace(conv, source="", id=None)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize("record", SHAPES, ids=["messages", "sharegpt", "interactions"])
def test_every_shape_in_every_file_type_reads_to_the_same_conversation(tmp_path, suffix, record):
    path = write_record_file(tmp_path / f"d{suffix}", [record, record])
    report = load_conversations(path)
    assert report.skipped == [] and len(report.conversations) == 2
    expected = _strip(parse_record(MESSAGES))
    assert all(_strip(c) == expected for c in report.conversations)
    assert report.conversations[1].id == record["id"]


def test_saved_dataset_and_dataset_dict(tmp_path):
    import datasets

    rows = [MESSAGES, dict(MESSAGES, id="m2")]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    report = load_conversations(tmp_path / "ds")
    assert [c.id for c in report.conversations] == ["m1", "m2"]
    assert report.conversations[0].source == f"{tmp_path / 'ds'} record 0"
    assert _strip(report.conversations[0]) == _strip(parse_record(MESSAGES))

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(rows[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_conversations(tmp_path / "dd").conversations) == 2  # train by default
    assert len(load_conversations(tmp_path / "dd", split="test").conversations) == 1
    with pytest.raises(DataError, match="no split 'dev'; have train, test"):
        load_conversations(tmp_path / "dd", split="dev")
    datasets.DatasetDict({"a": dd["train"], "b": dd["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataError, match="a DatasetDict with splits a, b; name one"):
        load_conversations(tmp_path / "ab")


def test_directory_of_data_files_with_splits(tmp_path):
    (tmp_path / "data").mkdir()
    write_record_file(tmp_path / "data" / "train-00000-of-00002.parquet", [MESSAGES])
    write_record_file(tmp_path / "data" / "train-00001-of-00002.jsonl", [SHAREGPT, SHAREGPT])
    write_record_file(tmp_path / "data" / "test-00000-of-00001.json", [INTERACTIONS])
    (tmp_path / ".cache").mkdir()
    write_record_file(tmp_path / ".cache" / "junk.jsonl", [MESSAGES])  # hidden: ignored
    assert [p.name for p in data_files(tmp_path, "train")] == ["train-00000-of-00002.parquet",
                                                               "train-00001-of-00002.jsonl"]
    assert len(load_conversations(tmp_path).conversations) == 4
    assert [c.id for c in load_conversations(tmp_path, split="train").conversations] == ["m1", "s1", "s1"]
    with pytest.raises(DataError, match="no data files for split 'dev'"):
        load_conversations(tmp_path, split="dev")


def test_errors_name_file_and_line(tmp_path):
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n\n" + json.dumps(bad) + "\n{not json\n")
    with pytest.raises(ConversationError, match=r"mixed\.jsonl line 3, message 1: unknown role 'bot'"):
        load_conversations(path)
    report = load_conversations(path, strict=False)
    assert len(report.conversations) == 1
    assert "line 3, message 1" in report.skipped[0] and "line 4: not valid JSON" in report.skipped[1]


def test_streaming_reads_only_what_is_asked(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n{broken\n")
    first = next(iter_conversation_records(path))
    assert first.index == 1 and first.parse().id == "m1"
    report = load_conversations(path, limit=1)  # stops before the broken line
    assert report.skipped == [] and len(report.conversations) == 1


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataNotFound, match="hub is offline"):
        load_conversations("devrev-research/MathChatSync-reasoning")
    with pytest.raises(DataNotFound, match="data file not found: nope.jsonl"):
        load_conversations("nope.jsonl")
    with pytest.raises(FileNotFoundError):  # still a FileNotFoundError for library callers
        load_conversations("nope.jsonl")


def test_builtin_and_synthetic_specs():
    assert [c.id for c in load_conversations("builtin:mathchat", limit=2).conversations] == \
        ["mathchat-followup-1", "mathchat-followup-2"]
    synth = load_conversations("synthetic:mathchat-sync", limit=3).conversations
    assert [c.id for c in synth] == ["synthetic-0-0", "synthetic-0-1", "synthetic-0-2"]
    with pytest.raises(ValueError, match="unknown synthetic workload"):
        load_conversations("synthetic:nope")


def test_to_record_round_trips(tmp_path):
    tool = {"id": "t", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
                         {"role": "assistant", "content": "", "reasoning_content": "call",
                          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                         {"role": "tool", "content": "1", "tool_call_id": "c"},
                         {"role": "assistant", "content": "done", "reasoning_content": "ok"}]}
    for record in (MESSAGES, SHAREGPT, INTERACTIONS, tool):
        conv = parse_record(record)
        assert parse_record(to_record(conv)) == conv
    path = tmp_path / "out.jsonl"
    assert write_records([to_record(parse_record(tool))], path) == 1
    assert parse_record(json.loads(path.read_text())) == parse_record(tool)


# ---------------------------------------------------------------------------------------------
# what a spec names: resolve_data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("rows"))


@pytest.mark.parametrize("kind,form", [("jsonl", "file"), ("json", "file"), ("parquet", "file"),
                                       ("folder", "folder"), ("saved", "saved"), ("builtin", "builtin"),
                                       ("synthetic", "synthetic")])
def test_every_conversation_spec_resolves_to_conversations(tmp_path, kind, form):
    spec = write_spec(kind, tmp_path)
    source = resolve_data(spec)
    assert (source.kind, source.form, source.spec) == ("conversations", form, spec)
    report = load_conversations(source, limit=2)
    assert report.skipped == [] and len(report.conversations) == 2
    if kind not in ("builtin", "synthetic"):
        assert [c.id for c in report.conversations] == [r["id"] for r in RECORDS[:2]]


def test_prepared_rows_are_recognised_by_their_columns_without_reading_them(prepared, monkeypatch):
    import datasets

    def no_reading(*args, **kwargs):
        raise AssertionError("resolve_data opened the dataset")

    monkeypatch.setattr(datasets, "load_from_disk", no_reading)
    source = resolve_data(prepared)
    assert (source.kind, source.form) == ("rows", "saved") and "prepared rows" in source.description


def test_conversation_readers_refuse_prepared_rows_in_one_line(prepared):
    with pytest.raises(DataError, match=r"prepared rows \(written by onepass prepare\), not conversations; "
                                        "this command needs conversations"):
        load_conversations(prepared)


def test_a_saved_dataset_of_other_columns_is_named_with_its_columns(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"text": "hi", "label": 1}]).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DataError, match=f"saved dataset {tmp_path / 'other'} has columns text, label: "
                                        "neither conversations .* nor prepared rows"):
        resolve_data(tmp_path / "other")


def test_prepared_rows_inside_a_dataset_dict_name_the_split_folder(tmp_path, prepared):
    import datasets

    rows = datasets.load_from_disk(prepared)
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=f"pass the split's folder {tmp_path / 'dd' / 'train'}"):
        resolve_data(tmp_path / "dd")
    assert resolve_data(tmp_path / "dd" / "train").kind == "rows"


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.jsonl", "data file not found: {path}"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "folder {path} has no data files"),
    (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", "{path}: unsupported file type '.txt'"),
    (lambda d: "builtin:nope", "unknown built-in data 'builtin:nope'"),
    (lambda d: "synthetic:nope", "unknown synthetic workload 'nope'"),
])
def test_anything_else_is_one_data_error_naming_what_was_found(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError, match=re.escape(message.format(path=path))):
        resolve_data(path)
