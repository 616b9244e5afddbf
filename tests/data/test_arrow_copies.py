"""The same records as JSONL, parquet and ``save_to_disk`` give byte-identical prepared rows (issue 23).

Arrow stores a column of objects as one struct type: every record's tool-call ``arguments`` and every
tool's ``parameters.properties`` get the keys of all the others, filled with null. Read back as they
are, ``{"city": "Paris"}`` is trained as ``{"city": "Paris", "expr": null}``
(:func:`onepass.conversation.records.without_nulls`). The generated records vary which keys each call and tool has
(drawn in one fixed order: Arrow keeps one key order per column, see docs/data.md).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.data.sources import load_conversations
from onepass.prepare.pipeline import prepare
from onepass.render.messages import template_messages
from onepass.layout.tree import COLUMNS, rows_to_columns

KEYS = {"city": st.sampled_from(["Paris", "北京", "Zürich"]), "days": st.integers(0, 9),
        "expr": st.sampled_from(["2+2", "x*y"]), "exact": st.booleans()}  # one value type per key


@st.composite
def arguments(draw):
    chosen = draw(st.lists(st.sampled_from(list(KEYS)), min_size=1, max_size=4, unique=True))
    return {k: draw(KEYS[k]) for k in KEYS if k in chosen}  # in KEYS' order


def tool(name, keys):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": "string"} for k in KEYS if k in keys}}}}


@st.composite
def records(draw, index):
    messages = [{"role": "user", "content": f"q{index}"}]
    names = set()
    for turn in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            name = draw(st.sampled_from(["weather", "calc"]))
            names.add(name)
            messages.append({"role": "assistant", "content": "", "reasoning_content": f"r{turn}",
                             "tool_calls": [{"id": f"c{turn}", "type": "function",
                                             "function": {"name": name, "arguments": draw(arguments())}}]})
            messages.append({"role": "tool", "content": f"out{turn}", "tool_call_id": f"c{turn}"})
        message = {"role": "assistant", "content": f"a{turn}"}
        if draw(st.booleans()):
            message["reasoning_content"] = f"why{turn}"
        messages += [message, {"role": "user", "content": f"more{turn}"}]
    # every record has "tools" (maybe empty): pyarrow and datasets take a table's columns from its first record
    return {"id": f"r{index}", "messages": messages[:-1], "tools": [
        tool(n, draw(st.lists(st.sampled_from(list(KEYS)), min_size=1, unique=True))) for n in sorted(names)]}


FIRST = {"id": "first", "tools": [tool("weather", KEYS)], "messages": [  # every key, in KEYS' order
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris", "days": 1, "expr": "x", "exact": True}}}]},
    {"role": "tool", "content": "18", "tool_call_id": "c"}, {"role": "assistant", "content": "a"}]}


def corpus():
    """A first record holding every key in KEYS' order, then 1 to 3 drawn ones. Arrow orders a struct's
    keys by their first appearance in the column, for every record: keys drawn in KEYS' order after
    FIRST keep their order (a record with another order has the column's in Arrow: docs/data.md)."""
    return st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(FIRST), *(records(i) for i in range(n))))


def prepared(spec, tokenizer):
    report = load_conversations(spec)
    assert report.skipped == []
    rows, _ = prepare(report.conversations, tokenizer)
    return rows_to_columns(rows), [template_messages(c) for c in report.conversations]


def write_all(records, folder: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = folder / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    parquet = folder / "d.parquet"
    pq.write_table(pa.Table.from_pylist(list(records)), parquet)
    saved = folder / "saved"
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(list(records)).save_to_disk(str(saved))
    return {"jsonl": jsonl, "parquet": parquet, "saved": saved}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(records=corpus())
def test_jsonl_parquet_and_saved_copies_give_byte_identical_rows(qwen3_tokenizer, records):
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_all(records, Path(tmp))
        (want, messages), *copies = [prepared(spec, qwen3_tokenizer) for spec in specs.values()]
        for name, (got, got_messages) in zip(list(specs)[1:], copies):
            assert got_messages == messages, name  # the records themselves: no null-filled keys
            for column in COLUMNS:
                assert [np.asarray(a).tobytes() for a in got[column]] == \
                       [np.asarray(a).tobytes() for a in want[column]], (name, column)


def test_a_parquet_copy_has_no_null_filled_arguments_or_tool_parameters(tmp_path):
    records = [
        {"tools": [tool("weather", ["city"])], "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18"}, {"role": "assistant", "content": "a"}]},
        {"tools": [tool("calc", ["expr"])], "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+2"}}}]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "a"}]},
    ]
    specs = write_all(records, tmp_path)
    for name in ("parquet", "saved"):
        first = load_conversations(specs[name]).conversations[0]
        assert first.messages[1].tool_calls[0].arguments == {"city": "Paris"}, name
        assert first.tools[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}, name


def test_an_in_memory_dataset_reads_as_its_records():
    """OnePassTrainer's path: a ``datasets.Dataset`` built from records fills every record's tool arguments
    with the other records' keys as nulls; they are dropped, so it reads as the records themselves."""
    import datasets

    from onepass.train.trainer.data import parse_dataset

    def chat(name, args):
        return {"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]}

    records = [chat("weather", {"city": "Paris"}), chat("calc", {"expr": "1+1"})]
    assert datasets.Dataset.from_list(records)[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "expr": None}  # what Arrow does
    got, want = parse_dataset(datasets.Dataset.from_list(records), source="ds"), parse_dataset(records, source="ds")
    assert [c.messages for c in got] == [c.messages for c in want]
