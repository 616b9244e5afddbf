"""What a single rendering trains, against onepass's views (issue 46 item 1): hand-counted cases on the real
Qwen3 template, TRL's own training template and assistant masks, and the figures in ``data stats`` and
``prepare``'s stats.json."""

from __future__ import annotations

import json
from pathlib import Path

from onepass.cli import main as cli
from onepass.conversation.parse import parse_record
from onepass.data.mathchat import load_sample
from onepass.prepare.config import DataConfig
from onepass.prepare.pipeline import prepare
from onepass.render import RenderConfig, render_conversation
from onepass.render.messages import template_messages
from onepass.render.single import SingleRendering, single_rendering, sum_counts, trl_training_template
from onepass.train.core.sft_rows import MESSAGES, SftSettings, tokenize_record

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
DROP_MARKED = Path(__file__).parents[2] / "benchmarks" / "policy" / "drop_marked.jinja"

R = ["First add 2 and 3.", "Then times 4 is 20.", "Minus one gives 19."]


def U(content):
    return {"role": "user", "content": content}


def A(content, reasoning, **kw):
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, **kw}


THREE = {"messages": [U("2+3?"), A("5.", R[0]), U("times 4?"), A("20.", R[1]), U("minus 1?"), A("19.", R[2])]}
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
CHAIN_THEN_USER = {"messages": [U("2+3?"), A("", R[0], tool_calls=[CALL]), {"role": "tool", "content": "5"},
                                A("It is 5.", R[1]), U("thanks")]}


def counts(tok, record, config=RenderConfig(), **kw) -> SingleRendering:
    conv = parse_record(record)
    return single_rendering(conv, tok, config, render_conversation(conv, tok, config, keep_texts=True), **kw)


def tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_the_qwen3_rule_trains_earlier_turns_without_their_reasoning(qwen3_tokenizer):
    got = counts(qwen3_tokenizer, THREE, check_prompts=True)
    assert (got.turns, got.turns_with_reasoning, got.single_without_reasoning) == (3, 3, 2)
    assert got.single_untrained_reasoning_tokens == tokens(qwen3_tokenizer, R[0]) + tokens(qwen3_tokenizer, R[1])
    assert got.reasoning_tokens == sum(tokens(qwen3_tokenizer, r) for r in R)
    assert (got.single_on_unseen_reasoning, got.single_missing_seen_reasoning) == (0, 0)
    assert (got.onepass_views, got.onepass_without_reasoning, got.onepass_untrained_reasoning_tokens) == (3, 0, 0)
    assert (got.onepass_prompts_checked, got.onepass_on_unseen_reasoning, got.onepass_missing_seen_reasoning) == \
        (2, 0, 0)  # turn 1 has no earlier turn


def test_a_trailing_user_message_drops_the_last_turns_reasoning_too(qwen3_tokenizer):
    """tau-bench records end with the user's last word: rendered whole, the template drops every turn's
    reasoning; and the answer after the tool call is trained without the call's reasoning, which its
    inference prompt shows (Qwen3 keeps reasoning after the last user message)."""
    got = counts(qwen3_tokenizer, CHAIN_THEN_USER)
    assert (got.turns, got.single_without_reasoning, got.single_missing_seen_reasoning) == (2, 2, 1)
    assert got.single_untrained_reasoning_tokens == got.reasoning_tokens
    assert (got.onepass_without_reasoning, got.onepass_untrained_reasoning_tokens) == (0, 0)


def test_trls_training_template_keeps_reasoning_the_inference_prompt_never_shows(qwen3_tokenizer):
    """TRL's SFTTrainer swaps in its training variant of Qwen3's template under assistant_only_loss
    (trl.get_training_chat_template): every turn keeps its reasoning, so later turns learn after reasoning
    the model never sees at inference."""
    trl = trl_training_template(qwen3_tokenizer)
    assert trl != qwen3_tokenizer.chat_template and "{% generation %}" in trl.replace("{%-", "{%")
    got = counts(qwen3_tokenizer, THREE, template=trl)
    assert (got.single_without_reasoning, got.single_untrained_reasoning_tokens) == (0, 0)
    assert got.single_on_unseen_reasoning == 2


def test_only_the_selected_turns_count(qwen3_tokenizer):
    got = counts(qwen3_tokenizer, THREE, RenderConfig(train_turns="last"))
    assert (got.turns, got.single_without_reasoning, got.onepass_views) == (1, 0, 1)


def test_a_conversation_the_template_cannot_render_whole_is_counted(qwen3_tokenizer):
    """gpt-oss raises "Cannot pass both content and thinking" for a tool call holding both."""
    before = qwen3_tokenizer.chat_template
    qwen3_tokenizer.chat_template = (FIXTURES / "gptoss.jinja").read_text(encoding="utf-8")
    try:
        record = {"messages": [U("2+3?"), A("Checking.", R[0], tool_calls=[CALL]), {"role": "tool", "content": "5"},
                               A("It is 5.", R[1])]}
        got = counts(qwen3_tokenizer, record)
    finally:
        qwen3_tokenizer.chat_template = before
    assert (got.conversations, got.conversations_not_rendered, got.turns) == (0, 1, 0)
    assert "1 conversations the template cannot render whole" in got.summary()


def test_the_text_verdict_is_trls_assistant_mask(qwen3_tokenizer):
    """Token level: the reasoning a single rendering trains is the reasoning inside the tokens TRL's
    assistant mask trains (transformers' return_assistant_tokens_mask on the template with generation
    markers, which renders the same text as builtin:chatml_reasoning: benchmarks/policy)."""
    from onepass.render.tokenizer import builtin_template

    before = qwen3_tokenizer.chat_template
    qwen3_tokenizer.chat_template = builtin_template("chatml_reasoning")
    try:
        convs = load_sample(limit=12)
        config = RenderConfig()
        got = sum_counts(single_rendering(c, qwen3_tokenizer, config,
                                          render_conversation(c, qwen3_tokenizer, config, keep_texts=True))
                         for c in convs)
        settings = SftSettings(assistant_only_loss=True, chat_template=DROP_MARKED.read_text(encoding="utf-8"))
        untrained = untrained_tokens = 0
        for c in convs:
            row = tokenize_record({"messages": template_messages(c)}, MESSAGES, qwen3_tokenizer, settings)
            spans, span = [], []
            for t, label in zip(row.input_ids, row.labels):
                if label != -100:
                    span.append(t)
                elif span:
                    spans, span = spans + [span], []
            trained = [qwen3_tokenizer.decode(s) for s in spans + [span] if s]
            assert len(trained) == c.num_assistant_turns  # every assistant turn a target
            for m, text in zip([m for m in c.messages if m.role == "assistant"], trained):
                r = (m.reasoning or "").strip()
                if r and r not in text:
                    untrained += 1
                    untrained_tokens += tokens(qwen3_tokenizer, r)
    finally:
        qwen3_tokenizer.chat_template = before
    assert got.single_without_reasoning == untrained > 0
    assert got.single_untrained_reasoning_tokens == untrained_tokens


def test_prepare_writes_the_figures_to_stats_json(qwen3_tokenizer):
    convs = load_sample(limit=10)
    _, stats = prepare(convs, qwen3_tokenizer, DataConfig())
    single = stats.to_dict()["single_rendering"]
    assert single["turns"] == stats.views_trained and single["single_without_reasoning"] > 0
    assert single["onepass_without_reasoning"] == 0 and single["onepass_untrained_reasoning_tokens"] == 0
    assert "single rendering (one per conversation" in stats.summary()


def test_data_stats_prints_and_writes_them(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert cli(["data", "stats", "--data", "builtin:mathchat", "--limit", "20", "--no-progress", "--no-share-prefix",
                "--single-template", "trl", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    single = json.loads(out.read_text())["single_rendering"]
    assert single["single_without_reasoning"] == 0 and single["single_on_unseen_reasoning"] > 0
    assert single["onepass_prompts_checked"] > 0 and single["onepass_on_unseen_reasoning"] == 0
    assert f"{single['single_on_unseen_reasoning']} after earlier reasoning unseen at inference" in printed


def test_a_missing_single_template_is_one_line(capsys):
    assert cli(["data", "stats", "--data", "builtin:mathchat", "--limit", "2", "--no-progress",
                "--single-template", "missing.jinja"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chat template file not found: missing.jinja" in err[0]


def test_the_marked_qwen3_template_renders_qwen3s_text_and_marks_every_assistant_turn(qwen3_tokenizer):
    """benchmarks/policy/qwen3_drop_marked.jinja: what docs/policy.md hands TRL for policy (a) on a real Qwen3
    model (TRL keeps a template that has generation markers): Qwen3's text, every assistant turn marked."""
    from onepass.prepare.template_report import tool_chain_conversations

    marked = (DROP_MARKED.parent / "qwen3_drop_marked.jinja").read_text(encoding="utf-8")
    settings = SftSettings(assistant_only_loss=True, chat_template=marked)
    for conv in load_sample(limit=20) + tool_chain_conversations():
        messages = template_messages(conv)
        tools = [dict(t) for t in conv.tools] or None
        assert qwen3_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == \
            qwen3_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=marked)
        row = tokenize_record({"messages": messages, "tools": tools}, MESSAGES, qwen3_tokenizer, settings)
        starts = sum(1 for a, b in zip((-100, *row.labels), row.labels) if a == -100 and b != -100)
        assert starts == conv.num_assistant_turns
