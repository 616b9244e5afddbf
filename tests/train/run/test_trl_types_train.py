"""``onepass train`` on the dataset types ``OnePassTrainer`` takes: TRL's text, prompt-completion (standard and
conversational) and tokenized records beside conversations, in one JSONL file (issue 47.3)."""

from __future__ import annotations

import json
import math

import pytest

from onepass.data.sources import resolve_data
from onepass.errors import DataError
from onepass.layout.tree import IGNORE
from onepass.train.config import load_config
from onepass.train.run.data import load_train_data
from onepass.train.run.loop import train

CONVERSATION = {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                             {"role": "assistant", "content": "It is 5."}]}
PROMPT_COMPLETION = {"prompt": "The capital of France is", "completion": " Paris."}
CHAT_PROMPT_COMPLETION = {"prompt": [{"role": "user", "content": "Say hi."}],
                          "completion": [{"role": "assistant", "content": "Hi!"}]}
TEXT = {"text": "A tree shares its prefix once."}
TOKENIZED = {"input_ids": [11, 12, 13, 14, 15], "labels": [-100, -100, 13, 14, 15]}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config_of(tmp_path, data, **overrides):
    values = dict(tiny="qwen3", data=str(data), per_device_train_batch_size=2, learning_rate=3e-3, progress=False,
                  save_model=False, output_dir=str(tmp_path / "out"), seed=0)
    return load_config(None, {**values, **overrides})


def test_onepass_train_trains_every_trl_dataset_type_end_to_end(tmp_path):
    data = write(tmp_path / "mixed.jsonl", [CONVERSATION, PROMPT_COMPLETION, CHAT_PROMPT_COMPLETION, TEXT, TOKENIZED])
    lines: list[str] = []
    result = train(config_of(tmp_path, data, max_steps=3, tiny_config={"hidden_size": 32, "intermediate_size": 64}),
                   log=lines.append)
    metrics = json.loads(result.metrics_path.read_text())
    assert result.steps == 3 and all(math.isfinite(x) for x in result.losses)
    assert metrics["units"] == 5  # the conversation and four TRL rows: none skipped
    assert metrics["data_stats"]["conversations"] == 1 and metrics["data_stats"]["trl_rows"] == 4
    assert any("4 records of TRL's dataset types" in line for line in lines)


def test_a_prompt_completion_record_trains_its_completion_as_trl_does(tmp_path, qwen3_tokenizer):
    data = write(tmp_path / "pc.jsonl", [PROMPT_COMPLETION])
    (unit,) = load_train_data(resolve_data(data), config_of(tmp_path, data), qwen3_tokenizer).units
    (row,) = unit
    prompt = qwen3_tokenizer(PROMPT_COMPLETION["prompt"], add_special_tokens=False)["input_ids"]
    full = qwen3_tokenizer(PROMPT_COMPLETION["prompt"] + PROMPT_COMPLETION["completion"] + qwen3_tokenizer.eos_token,
                           add_special_tokens=False)["input_ids"]
    assert full[:len(prompt)] == prompt and row.input_ids.tolist() == full
    assert row.kv_end.tolist() == [len(full)] * len(full)  # one causal sequence
    trained = [int(t) for t in row.targets if t != IGNORE]
    assert trained == full[len(prompt):]  # the completion and EOS, each predicted by the token before it
    assert row.weights.sum() == len(trained)


def test_a_record_trl_refuses_or_over_max_tokens_is_a_counted_skip_naming_its_line(tmp_path, qwen3_tokenizer):
    data = write(tmp_path / "bad.jsonl", [CONVERSATION, {"prompt": "a", "completion": 3},
                                          {"text": "word " * 400}, {"input_ids": [1, 2, 10 ** 7]},
                                          {"prompt": None, "completion": None}])
    lines: list[str] = []
    loaded = load_train_data(resolve_data(data), config_of(tmp_path, data, max_tokens=256), qwen3_tokenizer,
                             log=lines.append)
    assert loaded.num_units == 1 and "trl_rows" not in loaded.stats
    assert loaded.stats["skipped_by_reason"] == {"invalid record": 3, "over max_tokens": 1}
    (summary,) = [line for line in lines if line.startswith("skipped")]
    assert f"first: {data} line 2: " in summary  # the file and line (1-based) of the record
    skipped = loaded.stats["skipped"]  # invalid records first, each naming its line
    assert skipped[1] == f"{data} line 4: input_ids holds 10000000, outside the tokenizer's vocabulary of 151669"
    assert skipped[2].startswith(f"{data} line 5: ")
    assert skipped[3] == f"{data} line 3: 402 tokens, more than max_tokens=256"


def test_conversation_files_read_as_before(tmp_path, qwen3_tokenizer):
    """Records that are not conversations nor TRL's types are skipped with the same line as ever."""
    data = write(tmp_path / "c.jsonl", [CONVERSATION, {"question": "q", "answer": "a"}])
    loaded = load_train_data(resolve_data(data), config_of(tmp_path, data), qwen3_tokenizer)
    assert loaded.num_units == 1 and loaded.stats["skipped_by_reason"] == {"invalid record": 1}
    assert "a question/answer record" in loaded.stats["skipped"][0]


def test_a_saved_dataset_of_prompt_completion_records_is_a_data_source(tmp_path, qwen3_tokenizer):
    """A ``save_to_disk`` folder of TRL's records, as OnePassTrainer is given them, is ``--data`` for onepass train."""
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([PROMPT_COMPLETION, {"prompt": "One and one make", "completion": " two."}]
                               ).save_to_disk(str(folder))
    loaded = load_train_data(resolve_data(folder, trl_records=True), config_of(tmp_path, folder), qwen3_tokenizer)
    assert loaded.num_units == 2 and loaded.stats["trl_rows"] == 2
    assert all(u[0].num_targets > 0 for u in loaded.units)
    with pytest.raises(DataError, match="neither conversations"):  # the commands that take conversations only
        resolve_data(folder)
    result = train(config_of(tmp_path, folder, max_steps=1, tiny_config={"hidden_size": 32, "intermediate_size": 64}),
                   log=lambda _line: None)  # the run resolves --data with TRL's types
    assert result.steps == 1 and math.isfinite(result.losses[0])
