"""A setting declared once (issue 47.4): its field carries help, flags, choices, range and resume relevance, and the
flag, the YAML key, the check, the resume key and ``OnePassConfig``'s field are generated from it.

Before (276772d), adding a setting meant editing up to five places (the field, ``RESUME_KEYS``, ``RANGES``,
``_validate``, ``OnePassConfig``'s field and ``_data_values``); a setting added in one place was missing from the
others without a word. These tests add one in one place and find it everywhere, and walk every real setting
through every consumer."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import pytest

import onepass.prepare.config
import onepass.render.clock
from onepass.errors import ConfigError
from onepass.prepare.config import DATA_KEYS, DataConfig
from onepass.settings import Range, component, leaves, range_problem, ranges, resume_keys, setting
from onepass.train.cli import add_arguments, overrides_from_args
from onepass.train.config import (
    RESUME_KEYS,
    OptimConfig,
    TrainConfig,
    TrainConfigError,
    config_from_dict,
    config_keys,
    load_config,
)

BASE = {"tiny": "qwen3", "data": "builtin:mathchat"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SmoothedOptim(OptimConfig):
    label_smoothing: float = setting(0.0, "label smoothing", range=Range(low=0.0, high=1.0, high_open=True),
                                     resume=True, hf=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class SmoothedConfig(TrainConfig):
    optim_config: SmoothedOptim = component(SmoothedOptim, "optimisation")


def _parse(config: type, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, config)
    return overrides_from_args(parser.parse_args(argv))


def test_a_setting_added_in_one_place_is_a_flag_a_yaml_key_a_check_and_a_resume_key():
    values = _parse(SmoothedConfig, ["--tiny", "qwen3", "--data", "builtin:mathchat", "--label-smoothing", "0.1"])
    assert values == {**BASE, "label_smoothing": 0.1}
    assert _parse(SmoothedConfig, ["--label_smoothing", "0.1"]) == {"label_smoothing": 0.1}  # HF's spelling too
    config = config_from_dict(values, config=SmoothedConfig)
    assert config.label_smoothing == config.optim_config.label_smoothing == 0.1  # read flat and nested
    assert "label_smoothing" in config_keys(SmoothedConfig) and config.to_dict()["label_smoothing"] == 0.1
    assert config_from_dict({**BASE, "label_smoothing": "0.2"}, config=SmoothedConfig).label_smoothing == 0.2  # YAML
    with pytest.raises(TrainConfigError, match=r"^label_smoothing must be in \[0, 1\), got 1.5$"):
        config_from_dict({**BASE, "label_smoothing": 1.5}, config=SmoothedConfig)
    assert "label_smoothing" in resume_keys(SmoothedConfig) and "label_smoothing" in ranges(SmoothedConfig, hf=True)
    changed = config.replace(label_smoothing=0.3)
    assert changed.label_smoothing == 0.3 and changed.data_config is config.data_config  # the rest kept, not rebuilt
    # the real config has no such setting: unknown as a key, a flag and an attribute
    with pytest.raises(TrainConfigError, match="unknown config key 'label_smoothing'"):
        config_from_dict({**BASE, "label_smoothing": 0.1})
    assert "label_smoothing" not in RESUME_KEYS and not hasattr(load_config(None, BASE), "label_smoothing")


@dataclass(frozen=True, kw_only=True)
class BeamData(DataConfig):
    beam: int = setting(2, "beam width", range=Range(low=1, integer=True), resume=True)


def test_a_data_setting_added_in_one_place_reaches_onepassconfig():
    from transformers import HfArgumentParser

    from onepass.train.hf_config import OnePassConfig, with_data_settings

    @dataclass
    @with_data_settings(BeamData)
    class BeamArgs(OnePassConfig):
        pass

    args = BeamArgs("o", beam=3, report_to="none", use_cpu=True)
    assert type(args.data_config) is BeamData and args.data_config.beam == 3
    assert BeamArgs.__dataclass_fields__["beam"].metadata["help"] == "beam width"
    (parsed,) = HfArgumentParser(BeamArgs).parse_args_into_dataclasses(
        ["--output_dir", "o", "--beam", "4", "--report_to", "none", "--use_cpu", "--max_length", "64"])
    assert parsed.data_config.beam == 4 and parsed.data_config.max_tokens == 64
    with pytest.raises(ConfigError, match="^beam must be >= 1, got 0$"):
        BeamArgs("o", beam=0, report_to="none", use_cpu=True)
    assert "beam" in resume_keys(BeamData)


def _out_of_range(leaf):
    """A value of the setting's type just outside its range (NaN where it has no bounds)."""
    rule = leaf.meta["range"]
    if rule.low is None and rule.high is None:
        return math.nan
    bad = (rule.low if rule.low_open else rule.low - 1) if rule.low is not None else rule.high + 1
    return int(bad) if str(leaf.field.type).startswith("int") else float(bad)


LEAVES = leaves(TrainConfig)


@pytest.mark.parametrize("leaf", LEAVES, ids=[leaf.name for leaf in LEAVES])
def test_every_setting_reaches_every_consumer(leaf):
    """Each setting of ``onepass train``: one flag (and HF's spelling), one YAML key, read flat, its resume relevance
    in RESUME_KEYS, its choices and range checked with the line its metadata makes; a data setting is an
    ``OnePassConfig`` field with its help; a range ``TrainingArguments`` shares is ``OnePassConfig``'s too."""
    from onepass.train.hf_config import FLAT_SPELLING, OnePassConfig
    from onepass.train.hyperparams import RANGES

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    options = {o for a in parser._actions if a.dest == leaf.name for o in a.option_strings}
    assert "--" + leaf.name.replace("_", "-") in options and ("_" not in leaf.name or "--" + leaf.name in options)
    config = load_config(None, BASE)
    assert leaf.name in config_keys() and leaf.name in config.to_dict()
    nested = config
    for part in (*leaf.path, leaf.name):
        nested = getattr(nested, part)
    assert getattr(config, leaf.name) is nested
    assert (leaf.name in RESUME_KEYS) == leaf.meta["resume"]
    if leaf.meta["choices"] is not None:
        with pytest.raises(ConfigError, match=f"^unknown {leaf.meta['what'] or leaf.name} 'nope'; use one of "):
            load_config(None, {**BASE, leaf.name: "nope"})
    rule = leaf.meta["range"]
    if rule is not None:
        bad = _out_of_range(leaf)
        with pytest.raises(ConfigError) as raised:
            load_config(None, {**BASE, leaf.name: bad})
        assert str(raised.value) == range_problem(leaf.name, bad, rule)
    if leaf.path[-1] == "data_config" and FLAT_SPELLING.get(leaf.name, {}) is not None:
        hf = OnePassConfig.__dataclass_fields__[leaf.name]
        assert hf.metadata["help"] == (FLAT_SPELLING.get(leaf.name) or {}).get("help", leaf.meta["help"])
    if leaf.meta["hf"]:
        assert RANGES[leaf.name] is rule
        if leaf.name not in OnePassConfig.__dataclass_fields__:  # warmup_ratio: gone from transformers 5.x
            return
        with pytest.raises(ValueError) as from_hf:  # TrainingArguments refuses a negative warmup_steps first
            OnePassConfig("o", report_to="none", use_cpu=True, **{leaf.name: _out_of_range(leaf)})
        if isinstance(from_hf.value, ConfigError):
            assert str(from_hf.value) == range_problem(leaf.name, _out_of_range(leaf), rule)


def test_onepassconfig_has_every_data_setting_but_pack():
    from onepass.train.hf_config import OnePassConfig

    fields = set(OnePassConfig.__dataclass_fields__)
    assert set(DATA_KEYS) - fields == {"pack"}  # TRL's packing packs


def test_the_resume_keys_are_those_compared_before():
    """RESUME_KEYS is generated now; the set is the hand-kept list of 276772d."""
    assert set(RESUME_KEYS) == {
        "model", "tiny", "tiny_config", "compact_vocab", "tokenizer", "chat_template", "completion_format",
        "template_kwargs", "reasoning", "train_turns", "data", "eval_data", "limit", "schedule", "max_tokens", "pack",
        "weighting", "finetune", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "optim",
        "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type",
        "warmup_ratio", "warmup_steps", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
        "seed", "dtype", "mixed_precision", "sp_size"}


def test_a_component_is_checked_when_it_is_built():
    with pytest.raises(TrainConfigError, match=r"^learning_rate must be >= 0, got -1.0$"):
        OptimConfig(learning_rate=-1.0)
    assert OptimConfig(max_steps=3, num_train_epochs=math.inf).max_steps == 3  # epochs unread under max_steps


@pytest.fixture
def resolves(monkeypatch):
    """Every call of ``resolve_template_date``, wherever a module of ours imported it from."""
    import sys

    original = onepass.render.clock.resolve_template_date
    calls: list = []

    def counting(value, **kwargs):
        calls.append(value)
        return original(value, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("onepass") and getattr(module, "resolve_template_date", None) is original:
            monkeypatch.setattr(module, "resolve_template_date", counting)
    return calls


def test_onepassconfig_resolves_the_template_date_once(resolves):
    """The date is resolved where DataConfig is built, once; OnePassConfig shows the resolved one (before: it
    resolved it itself and DataConfig again)."""
    from onepass.train.hf_config import OnePassConfig

    args = OnePassConfig("o", report_to="none", use_cpu=True)
    assert len(resolves) == 1
    assert args.template_date == args.data_config.template_date == args.to_dict()["template_date"] is not None
    assert len(resolves) == 1  # read again: not resolved again
    assert onepass.prepare.config.DataConfig(template_date="2030-01-02").template_date == "2030-01-02"
