"""One DataConfig: defined once, parsed once, one flag per field everywhere, the guard's inputs passed explicitly."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import pytest

import onepass.cli
import onepass.prepare.parallel
import onepass.prepare.pipeline
import onepass.layout.schedule
import onepass.train.config
import onepass.train.run.data
from onepass.data.sources import resolve_data
from onepass.prepare.config import DATA_KEYS, DataConfig, data_config_from_args
from onepass.errors import ConfigError
from onepass.layout.schedule import Schedule
from onepass.settings import leaves

from strategies import synthetic_conversations


@pytest.fixture
def parses(monkeypatch):
    """Every call of ``parse_schedule``, wherever a module of ours imported it from."""
    original = onepass.layout.schedule.parse_schedule
    calls: list[str] = []

    def counting(spec):
        calls.append(spec)
        return original(spec)

    for name, module in list(sys.modules.items()):
        if name.startswith("onepass") and getattr(module, "parse_schedule", None) is original:
            monkeypatch.setattr(module, "parse_schedule", counting)
    return calls


@pytest.mark.parametrize("flags", [[], ["--schedule", "k-pass:2"]])
def test_prepare_parses_the_schedule_once_per_run(flags, parses, tmp_path, capsys):
    argv = ["prepare", "--data", "builtin:mathchat", "--limit", "3", "--out", str(tmp_path / "o"), "--no-progress"]
    assert onepass.cli.main(argv + flags) == 0
    assert len(parses) == 1, parses
    assert (tmp_path / "o" / "stats.json").is_file()


def test_train_parses_the_schedule_once_per_run(parses, qwen3_tokenizer):
    config = onepass.train.config.load_config(None, {"tiny": "qwen3", "data": "builtin:mathchat", "limit": 3,
                                                     "schedule": "k-pass:2", "max_tokens": 4096})
    data = onepass.train.run.data.load_train_data(resolve_data("builtin:mathchat"), config, qwen3_tokenizer)
    assert data.num_units == 3 and data.stats["schedule"] == "k-pass:2"
    assert len(parses) == 1, parses


def test_one_pass_trainer_data_parses_the_schedule_once(parses, qwen3_tokenizer):
    import datasets

    from onepass.train.hf_config import OnePassConfig
    from onepass.train.trainer.records import as_rows

    args = OnePassConfig("o", schedule="k-pass:2", report_to="none", use_cpu=True)
    rows = as_rows(datasets.Dataset.from_list(synthetic_conversations(3)), qwen3_tokenizer, args, source="train")
    assert len(rows.dataset) == 3 and args.data_config is args.data_config  # built once, then kept
    assert len(parses) == 1, parses
    args.schedule = "n-pass"  # a field set after construction is seen (TrainingArguments are mutable)
    assert args.data_config.schedule_spec == Schedule(kind="n-pass") and len(parses) == 2


def test_a_schedule_given_parsed_is_not_parsed_again(parses):
    config = DataConfig(schedule=Schedule(kind="k-pass", k=3), max_tokens=64)
    assert (config.schedule, config.replace(pack=True).schedule_spec) == ("k-pass:3", Schedule(kind="k-pass", k=3))
    assert parses == []


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = onepass.cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_every_data_config_field_is_one_flag_of_prepare_and_train(command):
    parser = _subparser(command)
    flags, hidden = {}, {}
    for action in parser._actions:
        if action.dest in DATA_KEYS:
            listed = action.help is not argparse.SUPPRESS
            assert action.dest not in (flags if listed else hidden), f"two flags for {action.dest}"
            (flags if listed else hidden)[action.dest] = action.option_strings
    assert set(flags) == set(DATA_KEYS)  # one-to-one: no field without a flag, no flag without a field
    for name, options in flags.items():
        assert "--" + name.replace("_", "-") in options
        assert "_" not in name or hidden[name] == ["--" + name]  # HF's spelling too, not listed in --help


def test_the_flags_read_back_into_the_same_data_config():
    argv = ["--schedule", "n-pass", "--max-tokens", "512", "--pack", "--weighting", "turn", "--completion-format",
            "think-tags", "--reasoning", "drop", "--template-kwarg", "enable_thinking=false"]
    expected = DataConfig(schedule="n-pass", max_tokens=512, pack=True, weighting="turn",
                          completion_format="think-tags", reasoning="drop", template_kwargs={"enable_thinking": False})
    prepare = _subparser("prepare").parse_args(["--data", "d", "--out", "o", *argv])
    assert data_config_from_args(prepare) == expected
    train = _subparser("train").parse_args(argv + ["--tiny", "qwen3", "--data", "builtin:mathchat"])
    from onepass.train.cli import overrides_from_args

    assert onepass.train.config.load_config(None, overrides_from_args(train)).data_config == expected
    assert data_config_from_args(_subparser("prepare").parse_args(["--data", "d", "--out", "o"])) == DataConfig()


def test_the_configs_hold_the_data_config_instead_of_repeating_it():
    from onepass.train.hf_config import OnePassConfig

    assert onepass.prepare.pipeline.PrepareConfig is DataConfig
    owners = {leaf.name: leaf.path for leaf in leaves(onepass.train.config.TrainConfig)}  # setting -> its component
    assert all(owners[name][-1] == "data_config" for name in DATA_KEYS)  # DataConfig's own, held, not repeated
    assert set(DATA_KEYS) <= set(onepass.train.config.config_keys())  # YAML keys stay flat
    hf = {f.name: f for f in dataclasses.fields(OnePassConfig)}
    for name in ("schedule", "weighting", "completion_format", "reasoning"):  # flat (SFTConfig), help from DataConfig
        assert hf[name].metadata["help"] == {f.name: f for f in dataclasses.fields(DataConfig)}[name].metadata["help"]


@pytest.mark.parametrize("values,message", [
    ({"schedule": "two-pass"}, "unknown schedule 'two-pass'"),
    ({"weighting": "row"}, "unknown weighting 'row'; use one of token, turn, conversation"),
    ({"reasoning": "maybe"}, "unknown reasoning 'maybe'; use one of keep, drop"),
    ({"pack": True}, "pack needs a row budget: set max_tokens"),
    ({"max_tokens": 1}, "max_tokens must be an integer >= 2"),
    ({"template_kwargs": ["a"]}, "template_kwargs must be a mapping"),
])
def test_bad_data_settings_are_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as e:
        DataConfig(**values)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# the guard's inputs: returned with the rows, passed by the trainer, never an attribute of the dataset


@pytest.fixture
def trainer_for(tmp_path, qwen3_tokenizer):
    import torch

    from onepass.model.tiny import tiny_model
    from onepass.train.hf_config import OnePassConfig
    from onepass.train.trainer.trainer import OnePassTrainer

    def make(train, **config):
        model = tiny_model("qwen3", len(qwen3_tokenizer), dtype=torch.float64, attn_implementation="sdpa")
        args = OnePassConfig(str(tmp_path / "out"), max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                             bf16=False, **config)
        return OnePassTrainer(model=model, args=args, train_dataset=train, processing_class=qwen3_tokenizer)

    return make


def test_the_guard_gets_its_inputs_from_the_trainer_not_from_a_dataset_attribute(trainer_for, qwen3_tokenizer,
                                                                                    caplog):
    import datasets

    from onepass.train.trainer.data import GuardInputs

    trainer = trainer_for(datasets.Dataset.from_list(synthetic_conversations(3)), schedule="one-pass")
    inputs = trainer.guard_inputs
    assert isinstance(inputs, GuardInputs) and not hasattr(trainer.train_dataset, "onepass_guard")
    assert (inputs.schedule, len(inputs.conversations), inputs.tokenizer) == (Schedule(kind="one-pass"), 3,
                                                                              qwen3_tokenizer)
    with caplog.at_level(logging.INFO, logger="onepass"):
        result = trainer.check_exactness()
    assert result.ok and "2 conversations of the training conversations" in caplog.text  # its own, sampled
    n_pass = dataclasses.replace(inputs, schedule=Schedule(kind="n-pass"))
    assert trainer.check_exactness(n_pass) == {"checked": False, "why": "n-pass rows are each one plain sequence"}


def test_rows_given_as_they_are_are_guarded_on_the_bundled_pair(trainer_for, qwen3_tokenizer, caplog):
    from onepass.conversation.parse import parse_record
    from onepass.train.trainer.data import conversation_dataset

    rows = conversation_dataset([parse_record(r) for r in synthetic_conversations(2)], qwen3_tokenizer)
    trainer = trainer_for(rows)
    assert trainer.guard_inputs is None and trainer.train_dataset is rows
    with caplog.at_level(logging.INFO, logger="onepass"):
        assert trainer.check_exactness().ok
    assert "the bundled MathChat pair" in caplog.text


@pytest.mark.parametrize("schedule,checked", [("n-pass", False), ("one-pass", True)])
def test_rows_given_as_they_are_are_read_for_shared_prefixes(trainer_for, qwen3_tokenizer, monkeypatch, schedule,
                                                            checked):
    """N-pass rows made by conversation_dataset (no guard inputs come with them) share no prefix: nothing to
    check, so a model the guard would refuse (a mixer onepass cannot lay out) still trains on them; one-pass
    rows given the same way are guarded."""
    import onepass.mixers.tree
    from onepass.conversation.parse import parse_record
    from onepass.guard import InexactModelError
    from onepass.model.tiny import tiny_model
    from onepass.train.trainer.data import conversation_dataset

    monkeypatch.setattr(onepass.mixers.tree, "recurrent_mixer", lambda cls: None)
    rows = conversation_dataset([parse_record(r) for r in synthetic_conversations(2)], qwen3_tokenizer,
                                schedule=schedule)
    trainer = trainer_for(rows)
    trainer.model = tiny_model("lfm2", len(qwen3_tokenizer), attn_implementation="sdpa")
    if checked:
        with pytest.raises(InexactModelError, match="not exact for Lfm2ForCausalLM"):
            trainer.check_exactness()
    else:
        assert trainer.check_exactness() == {"checked": False,
                                             "why": "no row shares a prefix between views (n-pass rows)"}
