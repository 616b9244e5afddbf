"""OnePassConfig is TrainingArguments with our fields; OnePassTrainer's datasets may be conversations."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import types
import typing
from pathlib import Path

import datasets
import pytest
from packaging.version import Version
from strategies import synthetic_conversations
from transformers import HfArgumentParser, TrainingArguments

from onepass.conversation.parse import parse_record
from onepass.errors import DataError, UsageError
from onepass.train import OnePassConfig
from onepass.train.trainer.trainer import as_rows, conversation_dataset, parse_dataset
from onepass.layout.tree import COLUMNS

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
    from onepass.train.config import TrainConfigError, config_from_dict
    from onepass.train.run.data import prepare_config

    data = {"tiny": "qwen3", "data": "builtin:mathchat"}
    assert prepare_config(config_from_dict({**data, "reasoning": "drop"})).render.reasoning == "drop"
    assert prepare_config(config_from_dict(data)).render.reasoning == "keep"
    with pytest.raises(TrainConfigError, match="unknown reasoning 'maybe'; use one of keep, drop"):
        config_from_dict({**data, "reasoning": "maybe"})


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh."""
    from onepass.train import hf_config

    monkeypatch.setattr(hf_config, "_WARNED", set())


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


MIRRORED_TRL = "1.16"  # the release SFT_FIELDS was written against; newer ones must match it exactly


def _accepts(ours, theirs):
    """Our annotation takes every value TRL's does (equal, or a union holding all of TRL's members)."""
    members = lambda t: set(typing.get_args(t)) if typing.get_origin(t) in (typing.Union, types.UnionType) else {t}
    return ours == theirs or members(theirs) <= members(ours)


def test_every_sft_config_field_exists_with_trls_default_or_a_written_reason():
    """A TRL release that adds a field (or changes a default) fails here until hf_config.SFT_FIELDS says
    what onepass does with it (and DEFAULT_DIFFERENCES why, for a default we do not follow)."""
    trl = pytest.importorskip("trl")
    from onepass.train.hf_config import DEFAULT_DIFFERENCES, SFT_FIELDS

    ours = {f.name: f for f in dataclasses.fields(OnePassConfig)}
    hf = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    our_types, trl_types = typing.get_type_hints(OnePassConfig), typing.get_type_hints(trl.SFTConfig)
    sft_specific = []
    for f in dataclasses.fields(trl.SFTConfig):
        assert f.name in ours, f"SFTConfig.{f.name} is missing from OnePassConfig"
        if hf.get(f.name) is not f:  # a field TRL adds or declares again
            sft_specific.append(f.name)
            assert f.name in SFT_FIELDS, f"SFTConfig.{f.name} (TRL {trl.__version__}) is not in hf_config.SFT_FIELDS"
        if Version(trl.__version__) < Version(MIRRORED_TRL):
            continue  # an older trl (make test-min): its fields exist; defaults and types follow MIRRORED_TRL
        if f.name in DEFAULT_DIFFERENCES:
            assert _default(ours[f.name]) != _default(f), f"{f.name}: listed as a difference but equal"
        else:
            assert _default(ours[f.name]) == _default(f), (f.name, _default(ours[f.name]), _default(f))
            assert _accepts(our_types[f.name], trl_types[f.name]), (f.name, our_types[f.name], trl_types[f.name])
    if Version(trl.__version__) >= Version(MIRRORED_TRL):
        assert sorted(SFT_FIELDS) == sorted(sft_specific), "SFT_FIELDS lists a field TRL no longer has"
    else:  # an older trl (make test-min): fields added since then are ours alone
        assert set(sft_specific) <= set(SFT_FIELDS)
    assert set(DEFAULT_DIFFERENCES) <= set(SFT_FIELDS)


def test_docs_table_has_a_row_for_every_sft_field_and_each_difference_with_its_reason():
    from onepass.train.hf_config import DEFAULT_DIFFERENCES, SFT_FIELDS

    docs = (Path(__file__).parents[2] / "docs" / "train.md").read_text()
    for name, what in SFT_FIELDS.items():
        assert f"| `{name}` | {what} |" in docs, name
    for name, why in DEFAULT_DIFFERENCES.items():
        assert why in docs, name


def test_values_onepass_does_otherwise_warn_once_each(caplog, fresh_warnings):
    lines = {"truncation_mode": "a conversation over max_length is split into trees",
             "packing_strategy": "conversation trees are never cut",
             "router_aux_loss_coef": "load-balancing loss is not added"}
    with caplog.at_level(logging.INFO, logger="onepass"):
        OnePassConfig("o", **COMMON)  # the defaults are what we do: nothing to say
        assert "onepass:" not in caplog.text
        for _ in range(2):
            with pytest.warns(FutureWarning, match="keep_end"):  # TRL's deprecation, as TRL says it
                OnePassConfig("o", completion_only_loss=False, truncation_mode="keep_end", packing=True,
                              packing_strategy="wrapped", router_aux_loss_coef=0.01, **COMMON)
    warnings_ = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == len(lines), caplog.text  # once each, not once per config
    for text in lines.values():
        assert sum(text in r.getMessage() for r in warnings_) == 1, text


def test_a_plain_training_arguments_with_the_releases_defaults_is_taken(tmp_path):
    """transformers 5.2 declares ``warmup_ratio: float | None = None`` (deprecated, gone in 5.24): a field left
    at the release's own None is not given, not out of range; None where the default is a number still is."""
    from onepass.train.config import TrainConfigError
    from onepass.train.trainer.trainer import as_onepass_config

    config = as_onepass_config(TrainingArguments(str(tmp_path), report_to=[], use_cpu=True), None)
    assert isinstance(config, OnePassConfig)
    with pytest.raises(TrainConfigError, match="learning_rate must be a number, got None"):
        OnePassConfig(str(tmp_path), learning_rate=None, use_cpu=True)


def test_sft_defaults_and_aliases():
    args = OnePassConfig("o", **COMMON)
    assert (args.learning_rate, args.logging_steps, args.max_length, args.max_tokens) == (2e-5, 10, 1024, 1024)
    assert args.gradient_checkpointing and args.bf16 and args.schedule == "budget"  # bf16: use_cpu=True here
    assert OnePassConfig("o", max_tokens=256, **COMMON).max_length == 256
    assert OnePassConfig("o", max_length=None, **COMMON).max_tokens is None  # no budget: one tree each
    with pytest.raises(ValueError, match="max_tokens is an alias of max_length"):
        OnePassConfig("o", max_length=512, max_tokens=256, **COMMON)
    assert OnePassConfig("o", loss_type="dft", **COMMON).loss_type == "dft"
    with pytest.warns(FutureWarning, match="chunked_nll"):
        assert OnePassConfig("o", loss_type="chunked_nll", **COMMON).loss_type == "nll"
    with pytest.raises(ValueError, match="Invalid `loss_type` mse passed. Supported values are 'nll' and 'dft'"):
        OnePassConfig("o", loss_type="mse", **COMMON)
    with pytest.warns(FutureWarning, match="renamed to `bfd_split`"):
        assert OnePassConfig("o", packing_strategy="bfd-requeue", **COMMON).packing_strategy == "bfd_split"
    assert OnePassConfig("o", pad_to_multiple_of="64", **COMMON).pad_to_multiple_of == 64
    (parsed,) = HfArgumentParser(OnePassConfig).parse_args_into_dataclasses(
        ["--output_dir", "o", "--eos_token", "<|im_end|>", "--packing", "--dataset_kwargs",
         '{"skip_prepare_dataset": true}', "--report_to", "none", "--use_cpu", "true"])
    assert parsed.packing and parsed.eos_token == "<|im_end|>" and parsed.dataset_prepared


def test_bf16_default_falls_back_where_the_machine_has_none(caplog, fresh_warnings, monkeypatch):
    from onepass.train import hf_config

    monkeypatch.setattr(hf_config, "_bf16_supported", lambda args: False)
    with caplog.at_level(logging.WARNING, logger="onepass"):
        assert OnePassConfig("o", report_to="none").bf16 is False
    assert "no bf16 support" in caplog.text
    assert OnePassConfig("o", fp16=False, bf16=False, report_to="none").bf16 is False


def test_onepass_config_imports_without_trl():
    code = ("import sys; sys.modules['trl'] = None\n"
            "import onepass, onepass.train\n"
            "from onepass.train import OnePassConfig, OnePassTrainer\n"
            "print(OnePassConfig('o', report_to='none', use_cpu=True).max_length)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "1024", proc.stderr[-2000:]


def test_a_dataset_of_conversations_becomes_one_row_per_conversation(qwen3_tokenizer):
    records = synthetic_conversations(3)
    expected = conversation_dataset([parse_record(r, index=i) for i, r in enumerate(records)], qwen3_tokenizer,
                                    schedule="n-pass")
    args = OnePassConfig("o", schedule="n-pass", **COMMON)
    ds = datasets.Dataset.from_list(records)
    for given in (ds, ds.to_iterable_dataset()):
        rows = as_rows(given, qwen3_tokenizer, args, source="train_dataset")
        assert rows.dataset.select_columns(list(COLUMNS)).to_dict() == expected.to_dict()
        assert str(rows.guard.schedule) == "n-pass" and "labels" in rows.dataset.column_names
        assert len(rows.guard.conversations) == 3 and rows.guard.tokenizer is qwen3_tokenizer
    passed = as_rows(expected, qwen3_tokenizer, args, source="x")  # prepared rows pass through, nothing to guard
    assert passed.dataset is expected and passed.guard is None
    with pytest.raises(UsageError, match="pass processing_class"):
        as_rows(ds, None, args, source="train_dataset")


def test_records_that_are_not_conversations_are_counted_skips(caplog):
    records = synthetic_conversations(2) + [{"messages": "not a list"}]
    with caplog.at_level(logging.WARNING, logger="onepass"):
        assert len(parse_dataset(records, source="train_dataset")) == 2
    assert "skipped 1 of 3 records of train_dataset" in caplog.text
    with pytest.raises(DataError, match="train_dataset has no conversations; first skip"):
        parse_dataset(records[2:], source="train_dataset")


@pytest.mark.parametrize("given, on", [({}, True), ({"activation_checkpointing": False}, False),
                                       ({"gradient_checkpointing": False}, False),
                                       ({"activation_checkpointing": True, "gradient_checkpointing": False}, True)])
def test_both_checkpointing_spellings_are_taken_as_trl_takes_them(given, on):
    """TRL's SFTConfig defaults gradient_checkpointing=True, the name transformers 5.24 deprecated for
    activation_checkpointing (a FutureWarning, removed in v6). OnePassConfig takes either; its default warns
    nothing; only a user's own old spelling warns (transformers' warning, as with TRL)."""
    import warnings

    from onepass.model.couplings import checkpointing_field, checkpointing_on

    if "activation_checkpointing" in given and checkpointing_field() != "activation_checkpointing":
        pytest.skip("this transformers has no activation_checkpointing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = OnePassConfig("o", **given, **COMMON)
    v6 = [str(w.message) for w in caught if "removed in v6" in str(w.message)]
    old_name_alone = "gradient_checkpointing" in given and "activation_checkpointing" not in given
    assert bool(v6) == (old_name_alone and checkpointing_field() == "activation_checkpointing"), v6
    assert checkpointing_on(args) is on and args.gradient_checkpointing is on
