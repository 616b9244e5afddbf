"""What ``OnePassTrainer`` makes of the datasets it is given (issue 44, items 1, 4, 6 and 13's second case).

Before the fix (b757769): tokenized rows whose ``labels`` (or masks) are shorter than ``input_ids`` were
broadcast (``input_ids`` [10, 20, 30, 40] with ``labels`` [10, 20] trained targets [20, 20, 20]) and longer
ones died in numpy (TRL cannot train either: its collator passes them on and the model's loss fails on the
shapes); a prompt given as messages with a text completion was a raw transformers ``TypeError``;
``packing=True, share_prefix=True`` shared nothing (the trainer's own packing path never called the sharing
code: 6 agent conversations gave the same row tokens either way); conversations whose every assistant turn
is ``weight: 0`` said "no conversations were given" (and ``prepare`` "the data has no conversations").
"""

from __future__ import annotations

import json

import datasets
import pytest

from onepass.cli import main
from onepass.data.synthetic import AgentConfig, agent_record
from onepass.train import OnePassConfig

ROW = {"input_ids": [10, 20, 30, 40]}
ZERO = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}", "weight": 0},
                      {"role": "user", "content": "more"}, {"role": "assistant", "content": "no", "weight": 0}]}
        for i in range(3)]


def _args(tmp_path, **kw):
    return OnePassConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kw)


def _rows(records, tokenizer, args):
    from onepass.train.trainer.records import as_rows

    return as_rows(datasets.Dataset.from_list(records), tokenizer, args, source="train_dataset")


@pytest.mark.parametrize("column,values", [("labels", [10, 20]), ("labels", [10, 20, 30, 40, 50]),
                                           ("assistant_masks", [1, 1]), ("completion_mask", [0, 1, 1])])
def test_a_token_column_of_another_length_than_input_ids_is_one_line(qwen3_tokenizer, tmp_path, column, values):
    from onepass.errors import DataError

    good = {**ROW, column: [1, 1, 1, 1]}
    args = _args(tmp_path, completion_only_loss=True)
    with pytest.raises(DataError, match=rf"^train_dataset record 1: {column} has {len(values)} entries, input_ids 4: "):
        _rows([good, {**ROW, column: values}], qwen3_tokenizer, args)


def test_given_rows_are_checked_too(qwen3_tokenizer, tmp_path):
    from onepass.errors import DataError

    args = _args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.raises(DataError, match="train_dataset record 0: labels has 2 entries, input_ids 4"):
        _rows([{**ROW, "labels": [10, 20]}], qwen3_tokenizer, args)


def test_rows_of_one_length_train_what_they_say(qwen3_tokenizer, tmp_path):
    # reference (passes on the old tree too): labels of the right length are TRL's, shifted
    out = _rows([{**ROW, "labels": [-100, 20, -100, 40]}], qwen3_tokenizer, _args(tmp_path)).dataset[0]
    assert out["targets"] == [20, -100, 40, -100]


@pytest.mark.parametrize("prompt,completion", [([{"role": "user", "content": "2+2?"}], "4"),
                                               ("2+2?", [{"role": "assistant", "content": "4"}])])
def test_a_prompt_and_a_completion_of_two_kinds_is_one_line(qwen3_tokenizer, tmp_path, prompt, completion):
    from onepass.errors import DataError

    with pytest.raises(DataError, match="train_dataset record 0: the prompt is .* and the completion is .*: give "
                                        "both as text"):
        _rows([{"prompt": prompt, "completion": completion}], qwen3_tokenizer, _args(tmp_path))


def test_packing_shares_the_prefix_of_conversations_that_share_one(qwen3_tokenizer, tmp_path):
    from onepass.layout.share import loss_terms, same_terms
    from onepass.layout.tree import row_from_columns

    small = AgentConfig(harnesses=1, prompt=(300,), tools=4, min_turns=1, max_turns=2, user=(4, 8), reasoning=(2, 5),
                        tool_result=(2, 6), answer=(2, 5), calls=(0, 1))
    records = [agent_record(i, 7, small) for i in range(6)]  # one system prompt and 4 tools, 6 conversations
    for r in records:
        r.pop("harness")
    out = {}
    for share in (True, False):
        args = _args(tmp_path, packing=True, max_length=8192, share_prefix=share, schedule="one-pass")
        out[share] = [row_from_columns(item) for item in _rows(records, qwen3_tokenizer, args).dataset]
    tokens = {share: sum(len(r) for r in rows) for share, rows in out.items()}
    assert tokens[True] < 0.6 * tokens[False], tokens  # the prompt and tools once per row, not once per conversation
    assert same_terms(loss_terms(out[True]), loss_terms(out[False]))  # the same loss terms: exact


def test_conversations_whose_every_turn_has_weight_0_say_so_in_the_trainer(qwen3_tokenizer, tmp_path):
    from onepass.errors import DataError

    with pytest.raises(DataError, match=r"^nothing to train: 3 conversations given, none trained: each of their 6 "
                                        r"assistant turns is marked not to train \(weight 0\)$"):
        _rows(ZERO, qwen3_tokenizer, _args(tmp_path))


def test_conversations_whose_every_turn_has_weight_0_say_so_in_prepare(tmp_path, capsys):
    data = tmp_path / "zero.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ZERO))
    code = main(["prepare", "--data", str(data), "--tokenizer", "builtin:qwen3", "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err == ("onepass: error: nothing to write: 3 conversations given, none trained: each of "
                                 "their 6 assistant turns is marked not to train (weight 0)"), err
    from onepass.prepare.pipeline import PrepareStats

    assert PrepareStats().none_trained() == "the data has no conversations"  # what is said when none was given


def test_conversations_whose_every_turn_has_weight_0_say_so_in_train(tmp_path):
    from onepass.errors import DataError
    from onepass.train.config import load_config
    from onepass.train.run.loop import train

    data = tmp_path / "zero.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ZERO))
    config = load_config(None, dict(tiny="qwen3", data=str(data), max_steps=1, progress=False, save_model=False,
                                    output_dir=str(tmp_path / "run")))
    with pytest.raises(DataError, match=rf"^nothing to train in {data}: 3 conversations given, none trained: each of "
                                        r"their 6 assistant turns is marked not to train \(weight 0\)$"):
        train(config, log=lambda _m: None)
