"""OnePassConfig is TrainingArguments with our fields; OnePassTrainer's datasets may be conversations."""

from __future__ import annotations

import logging

import datasets
import pytest
from strategies import synthetic_conversations
from transformers import HfArgumentParser, TrainingArguments

from onepass.conversation import parse_record
from onepass.errors import DataError, UsageError
from onepass.train import OnePassConfig
from onepass.train.hf_trainer import as_rows, conversation_dataset, parse_dataset

COMMON = {"report_to": "none", "use_cpu": True}


def test_hf_argument_parser_reads_our_fields_from_yaml_and_flags(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("output_dir: out\nlearning_rate: 0.001\nschedule: n-pass\nmax_length: 512\nreport_to: none\n"
                    "use_cpu: true\ntemplate_kwargs: {enable_thinking: false}\n")
    (args,) = HfArgumentParser(OnePassConfig).parse_yaml_file(str(path))
    assert isinstance(args, TrainingArguments) and args.learning_rate == 1e-3
    assert (args.schedule, args.max_tokens, args.template_kwargs) == ("n-pass", 512, {"enable_thinking": False})
    (args,) = HfArgumentParser(OnePassConfig).parse_args_into_dataclasses(
        ["--output_dir", "o", "--weighting", "turn", "--max_tokens", "256", "--template_kwargs",
         '{"enable_thinking": true}', "--allow_inexact", "true", "--report_to", "none", "--use_cpu", "true"])
    assert (args.weighting, args.max_tokens, args.allow_inexact) == ("turn", 256, True)
    assert args.render_config().template_kwargs == {"enable_thinking": True}
    assert args.render_config().reasoning == "keep"
    (args,) = HfArgumentParser(OnePassConfig).parse_args_into_dataclasses(
        ["--output_dir", "o", "--reasoning", "drop", "--report_to", "none", "--use_cpu", "true"])
    assert args.render_config().reasoning == "drop"


def test_train_config_reaches_the_render_config():
    """``onepass train --reasoning drop`` renders as ``prepare --reasoning drop`` does; a bad value is one line."""
    from onepass.train.config import TrainConfig
    from onepass.train.data import prepare_config

    from onepass.train.config import TrainConfigError

    data = {"tiny": "qwen3", "data": "builtin:mathchat"}
    assert prepare_config(TrainConfig(**data, reasoning="drop")).render.reasoning == "drop"
    assert prepare_config(TrainConfig(**data)).render.reasoning == "keep"
    with pytest.raises(TrainConfigError, match="unknown reasoning 'maybe'; use one of keep, drop"):
        TrainConfig(**data, reasoning="maybe")


def test_sft_names_we_cannot_honour_say_what_is_done_instead(caplog):
    with caplog.at_level(logging.INFO, logger="onepass"):
        OnePassConfig("o", packing=True, completion_only_loss=False, **COMMON)
    assert "packing=True" in caplog.text and "assistant turns only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onepass"):
        OnePassConfig("o", **COMMON)  # the defaults are what we do: nothing to say
    assert "onepass:" not in caplog.text
    with pytest.raises(ValueError, match="max_length is an alias of max_tokens"):
        OnePassConfig("o", max_length=512, max_tokens=256, **COMMON)


def test_a_dataset_of_conversations_becomes_one_row_per_conversation(qwen3_tokenizer):
    records = synthetic_conversations(3)
    expected = conversation_dataset([parse_record(r, index=i) for i, r in enumerate(records)], qwen3_tokenizer,
                                    schedule="n-pass")
    args = OnePassConfig("o", schedule="n-pass", **COMMON)
    ds = datasets.Dataset.from_list(records)
    for given in (ds, ds.to_iterable_dataset()):
        rows = as_rows(given, qwen3_tokenizer, args, source="train_dataset")
        assert rows.to_dict() == expected.to_dict() and rows.onepass_guard["schedule"] == "n-pass"
    assert as_rows(expected, qwen3_tokenizer, args, source="x") is expected  # prepared rows pass through
    with pytest.raises(UsageError, match="pass processing_class"):
        as_rows(ds, None, args, source="train_dataset")


def test_records_that_are_not_conversations_are_counted_skips(caplog):
    records = synthetic_conversations(2) + [{"messages": "not a list"}]
    with caplog.at_level(logging.WARNING, logger="onepass"):
        assert len(parse_dataset(records, source="train_dataset")) == 2
    assert "skipped 1 of 3 records of train_dataset" in caplog.text
    with pytest.raises(DataError, match="train_dataset has no conversations; first skip"):
        parse_dataset(records[2:], source="train_dataset")
