"""One reading of the offline variables, honoured by every place that could reach the hub."""

from __future__ import annotations

import doctest

import pytest

import onepass.hub
from onepass.hub import hub_offline, offline_reason

VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def test_docstring_example():
    result = doctest.testmod(onepass.hub)
    assert result.attempted >= 3 and result.failed == 0


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "On", " 1 "])
def test_every_true_spelling_is_offline(value):
    assert hub_offline(environ={"HF_HUB_OFFLINE": value})
    assert hub_offline("datasets", environ={"HF_HUB_OFFLINE": value})


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off"])
def test_false_spellings_are_online(value):
    assert not hub_offline(environ={k: value for k in VARIABLES})
    assert not hub_offline("datasets", environ={k: value for k in VARIABLES})


def test_each_library_switch_counts_only_for_its_kind():
    assert hub_offline("models", environ={"TRANSFORMERS_OFFLINE": "1"})
    assert not hub_offline("datasets", environ={"TRANSFORMERS_OFFLINE": "1"})
    assert hub_offline("datasets", environ={"HF_DATASETS_OFFLINE": "1"})
    assert not hub_offline("models", environ={"HF_DATASETS_OFFLINE": "1"})
    assert offline_reason("datasets", environ={"HF_HUB_OFFLINE": "yes", "HF_DATASETS_OFFLINE": "1"}) == \
        "HF_HUB_OFFLINE=yes, HF_DATASETS_OFFLINE=1"
    with pytest.raises(ValueError, match="unknown hub kind"):
        hub_offline("spaces")


def test_the_tokenizer_honours_true_not_only_1(monkeypatch):
    from onepass.render.tokenizer import TokenizerError, load_tokenizer

    for k in VARIABLES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(TokenizerError, match=r"hub is offline \(HF_HUB_OFFLINE=true\)"):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_hub_data_honours_the_datasets_switch(monkeypatch):
    from onepass.data.sources import load_conversations

    for k in VARIABLES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "on")
    with pytest.raises(FileNotFoundError, match=r"hub is offline \(HF_DATASETS_OFFLINE=on\)"):
        load_conversations("no-such-org/no-such-data")
