"""``--train-turns``: which assistant turns are trained (issue 46 item 3).

Each setting trains exactly its turns (a view each, the rest context, counted), and the one-pass loss
and gradients over the trees it makes are the N-pass loss over those turns alone, in float64: the N-pass
side is every turn's view rendered with the default setting, filtered by hand to the turns expected.
Every entry point takes the setting: prepare, train (YAML and flags), verify and OnePassTrainer.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from exactness import loss_and_grads, max_rel_diff
from onepass.cli import main as cli
from onepass.conversation.parse import parse_record
from onepass.data.sources import to_record
from onepass.conversation.turns import TRAIN_TURNS, selected_turns
from onepass.errors import ConfigError
from onepass.layout.vocab import remap, remap_layout, used_ids
from onepass.loss import layout_loss, view_loss_reference
from onepass.model.precision import float64_norms
from onepass.model.tiny import tiny_model
from onepass.prepare.config import DataConfig
from onepass.prepare.pipeline import prepare
from onepass.render import RenderConfig, render_conversation


def U(content):
    return {"role": "user", "content": content}


def A(content, reasoning, **kw):
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, **kw}


CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
RECORDS = [
    # four assistant turns, the second marked weight 1, one a tool call: all -> 1 3 5 7, last -> 7, weight -> 3
    {"messages": [U("2+3?"), A("", "Call the tool.", tool_calls=[CALL]), {"role": "tool", "content": "5"},
                  A("It is 5.", "The tool said 5.", weight=1), U("times 4?"), A("It is 20.", "5*4=20."),
                  U("minus 1?"), A("It is 19.", "20-1=19.")]},
    # the last turn marked weight 0: last trains nothing (both counted); weight trains none
    {"messages": [U("hi"), A("Hello.", "Greet."), U("bye"), A("Bye.", "Wave.", weight=0)]},
]
EXPECTED = {"all": [[1, 3, 5, 7], [1]], "last": [[7], []], "weight": [[3], []]}
NOT_SELECTED = {"all": 0, "last": 3 + 1, "weight": 3 + 1}  # trainable turns (not weight 0) left as context


@pytest.fixture(scope="module")
def convs():
    return [parse_record(r, source="t.jsonl", index=i) for i, r in enumerate(RECORDS)]


@pytest.mark.parametrize("train_turns", TRAIN_TURNS)
def test_each_setting_gives_views_to_its_turns_only_and_counts_the_rest(convs, qwen3_tokenizer, train_turns):
    assert [selected_turns(c, train_turns) for c in convs] == EXPECTED[train_turns]
    config = RenderConfig(train_turns=train_turns)
    rendered = [render_conversation(c, qwen3_tokenizer, config) for c in convs]
    assert [[v.turn for v in r.views] for r in rendered] == EXPECTED[train_turns]
    assert sum(r.not_selected for r in rendered) == NOT_SELECTED[train_turns]
    assert sum(r.not_trained for r in rendered) == 1  # the record's weight 0, whatever the setting
    _, stats = prepare(convs, qwen3_tokenizer, DataConfig(train_turns=train_turns))
    assert stats.views_trained == sum(map(len, EXPECTED[train_turns]))
    assert (stats.turns_not_selected, stats.turns_not_trained, stats.train_turns) == \
        (NOT_SELECTED[train_turns], 1, train_turns)
    assert stats.to_dict()["turns_not_selected"] == NOT_SELECTED[train_turns]
    if train_turns != "all":
        assert f"{NOT_SELECTED[train_turns]} assistant turns left as context (--train-turns {train_turns})" \
            in stats.summary()


def test_a_turn_left_as_context_is_in_the_later_prompts(convs, qwen3_tokenizer):
    (view,) = render_conversation(convs[0], qwen3_tokenizer, RenderConfig(train_turns="last")).views
    prompt = qwen3_tokenizer.decode(view.tokens[:view.num_prompt])
    assert all(text in prompt for text in ("It is 5.", "It is 20.", "<tool_call>"))


def test_an_unknown_setting_is_one_line():
    with pytest.raises(ConfigError, match="unknown train_turns 'first'; use one of all, last, weight"):
        DataConfig(train_turns="first")


def test_records_written_back_keep_their_marks(convs):
    """``to_record`` (``onepass data augment``'s output) writes ``weight`` back: a turn marked 0 read again
    from the written record must stay context, one marked 1 stay marked (b757769 wrote neither)."""
    again = [parse_record(json.loads(json.dumps(to_record(c)))) for c in convs]
    assert [[(m.train, m.marked) for m in c.messages] for c in again] == \
        [[(m.train, m.marked) for m in c.messages] for c in convs]
    assert [selected_turns(c, t) for t in TRAIN_TURNS for c in again] == \
        [selected_turns(c, t) for t in TRAIN_TURNS for c in convs]


@pytest.fixture(scope="module")
def exact(convs, qwen3_tokenizer):
    """Every turn's view (the default setting), a vocabulary compacted over them, and a float64 tiny Qwen3."""
    views = [render_conversation(c, qwen3_tokenizer).views for c in convs]
    used = used_ids(v.tokens for vs in views for v in vs)
    model = tiny_model("qwen3", len(used), dtype=torch.float64, seed=3)
    assert float64_norms(model)[0] > 0
    return views, used, model


@pytest.mark.parametrize("train_turns,weighting", [("all", "token"), ("last", "token"), ("weight", "token"),
                                                  ("last", "turn")])
def test_one_pass_loss_and_gradients_equal_n_pass_over_the_selected_turns(convs, qwen3_tokenizer, exact,
                                                                         train_turns, weighting):
    views, used, model = exact
    layouts, _ = prepare(convs, qwen3_tokenizer, DataConfig(train_turns=train_turns, weighting=weighting))
    layouts = [remap_layout(x, used) for x in layouts]
    chosen = [[v for v in vs if v.turn in turns] for vs, turns in zip(views, EXPECTED[train_turns])]

    def n_pass():
        total = torch.zeros((), dtype=torch.float64)
        for vs in chosen:
            for v in vs:
                weight = 1.0 if weighting == "token" else 1.0 / v.num_completion
                total = total + view_loss_reference(model, dataclasses.replace(v, tokens=remap(v.tokens, used)),
                                                    weight)
        return total

    one_pass = loss_and_grads(model, lambda: sum(layout_loss(model, x) for x in layouts))
    reference = loss_and_grads(model, n_pass)
    assert reference[0] > 0
    assert max_rel_diff(one_pass, reference) < 1e-9


def _write(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return str(path)


def test_prepare_and_verify_take_the_flag(tmp_path, convs, capsys):
    data = _write(tmp_path)
    out = tmp_path / "rows"
    assert cli(["prepare", "--data", data, "--tokenizer", "builtin:qwen3", "--out", str(out), "--train-turns",
                "last", "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["views_trained"], stats["turns_not_selected"], stats["train_turns"]) == (1, 4, "last")
    capsys.readouterr()
    assert cli(["verify", "--data", data, "--tokenizer", "builtin:qwen3", "--tiny", "qwen3", "--dtype", "float64",
                "--train-turns", "weight"]) == 0
    assert "1 views" in capsys.readouterr().out


def test_train_and_the_trainer_take_the_setting(qwen3_tokenizer, convs):
    from onepass.train.config import config_from_dict
    from onepass.train.run.data import prepare_config
    from onepass.train.hf_config import OnePassConfig
    from onepass.train.trainer.data import conversation_dataset

    train = config_from_dict({"tiny": "qwen3", "data": "builtin:mathchat", "train_turns": "last"})
    assert prepare_config(train).render.train_turns == "last"
    assert train.to_dict()["train_turns"] == "last"  # the YAML key, and what --resume compares
    args = OnePassConfig("o", train_turns="weight", report_to="none", use_cpu=True)
    assert args.render_config().train_turns == "weight"
    dataset, stats = conversation_dataset(convs, qwen3_tokenizer, data_config=args.data_config, return_stats=True)
    assert (len(dataset), stats.views_trained, stats.turns_not_selected) == (1, 1, 4)
