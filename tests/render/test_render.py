"""Views equal the template's own rendering, with the real Qwen3 template and vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from onepass.conversation.parse import Conversation, Message, ToolCall, parse_record
from onepass.errors import ConversationError, UsageError
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.render import (
    RenderConfig,
    RenderError,
    TemplateRaised,
    render_conversation,
    render_texts,
    render_views,
)
from onepass.render.fields import template_fields
from onepass.render.messages import template_messages
from onepass.render.tokenizer import builtin_template, load_tokenizer

SHARED_TEMPLATE = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "chat_templates" / "qwen3.jinja"

CHAIN = Conversation(messages=(
    Message(role="user", content="17*23?"),
    Message(role="assistant", content="", reasoning="call the tool",
            tool_calls=(ToolCall(name="calc", arguments={"expr": "17*23"}),)),
    Message(role="tool", content="391"),
    Message(role="assistant", content="391", reasoning="tool says 391"),
    Message(role="user", content="plus 9?"),
    Message(role="assistant", content="400", reasoning="391+9"),
))

CHAIN_NO_REASONING = Conversation(messages=(
    Message(role="user", content="17*23?"),
    Message(role="assistant", content="", tool_calls=(ToolCall(name="calc", arguments={"expr": "17*23"}),)),
))

# DeepSeek-R1 style: reasoning is never rendered, the generation prompt opens <think>.
R1_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
# Never renders reasoning, but the generation prompt is a prefix.
NO_REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_shipped_template_is_the_original(qwen3_tokenizer):
    if not SHARED_TEMPLATE.is_file():
        pytest.skip("shared fixtures not present")
    assert builtin_template("qwen3") == SHARED_TEMPLATE.read_text(encoding="utf-8")
    assert qwen3_tokenizer.convert_tokens_to_ids("<think>") == 151667


def test_every_view_equals_the_templates_own_rendering(qwen3_tokenizer):
    tok = qwen3_tokenizer
    views = render_views(CHAIN, tok)
    assert [v.turn for v in views] == [1, 3, 5]
    for v in views:
        msgs = template_messages(CHAIN, v.turn)
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(template_messages(CHAIN, v.turn + 1), tokenize=False)
        assert full.startswith(prompt)
        assert v.tokens.tolist() == encode(tok, prompt) + encode(tok, full[len(prompt):])
        assert v.num_prompt == len(encode(tok, prompt))


def test_qwen3_keeps_reasoning_inside_the_tool_chain_and_drops_it_after(qwen3_tokenizer):
    texts = {turn: (p, c) for turn, p, c in render_texts(CHAIN, qwen3_tokenizer)}
    # turn 3 follows a tool result: the chain's earlier reasoning is in its prompt
    assert "call the tool" in texts[3][0]
    assert texts[1][1].startswith("<think>\ncall the tool\n</think>\n\n<tool_call>")
    # turn 5 follows a new user query: earlier reasoning is dropped
    assert "call the tool" not in texts[5][0] and "tool says 391" not in texts[5][0]
    assert texts[5][1] == "<think>\n391+9\n</think>\n\n400<|im_end|>\n"


def test_empty_reasoning_renders_an_empty_think_block_that_is_trained(qwen3_tokenizer):
    conv = parse_record({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello", "reasoning_content": ""}]})
    (_, _, completion), = render_texts(conv, qwen3_tokenizer)
    assert completion == "<think>\n\n</think>\n\nhello<|im_end|>\n"
    (view,) = render_views(conv, qwen3_tokenizer)
    assert qwen3_tokenizer.decode(view.tokens[view.num_prompt:]) == completion


def test_enable_thinking_false_puts_the_empty_block_in_the_prompt(qwen3_tokenizer):
    conv = parse_record({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello", "reasoning_content": ""}]})
    cfg = RenderConfig(template_kwargs={"enable_thinking": False})
    ((_, prompt, completion),) = render_texts(conv, qwen3_tokenizer, cfg)
    assert prompt.endswith("<think>\n\n</think>\n\n") and completion == "hello<|im_end|>\n"


def test_template_that_does_not_start_with_its_generation_prompt_is_an_error(with_template):
    tok = with_template(R1_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "r"}]},
                        source="r1.jsonl", index=7)
    with pytest.raises(RenderError, match=r"r1.jsonl record 7, message 1: .*generation prompt opens '<think>\\n'"
                                          r".*--completion-format deepseek-r1"):
        render_views(conv, tok)
    # with the documented completion format it works: prompt as rendered, completion from the format,
    # ended the way the template ends a turn (not the tokenizer's EOS, here Qwen's <|im_end|>)
    (view,) = render_views(conv, tok, RenderConfig(completion_format="deepseek-r1"))
    assert tok.decode(view.tokens[:view.num_prompt]).endswith("<think>\n")
    assert tok.decode(view.tokens[view.num_prompt:]) == "r\n</think>\n\na<｜end▁of▁sentence｜>"


def test_template_that_never_renders_reasoning_is_an_error(with_template):
    tok = with_template(NO_REASONING_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "why"}]})
    with pytest.raises(RenderError, match="does not render this turn's reasoning"):
        render_views(conv, tok)
    (view,) = render_views(conv, tok, RenderConfig(completion_format="think-tags"))
    assert tok.decode(view.tokens[view.num_prompt:]).startswith("<think>\nwhy\n</think>")


def test_bpe_merge_across_the_boundary_is_counted(with_template):
    # R1 prompt ends "<think>\n"; an empty reasoning completion starts "\n</think>": "\n"+"\n" merge
    tok = with_template(R1_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": ""}]})
    cfg = RenderConfig(completion_format="deepseek-r1")
    (view,) = render_views(conv, tok, cfg)
    assert view.boundary_merge
    _, stats = prepare([conv], tok, PrepareConfig(completion_format="deepseek-r1"))
    assert stats.boundary_merge_views == 1


def test_bad_completion_format_is_an_error(qwen3_tokenizer):
    conv = parse_record({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    with pytest.raises(RenderError, match="bad completion format"):
        render_views(conv, qwen3_tokenizer, RenderConfig(completion_format="{answer}"))


def test_tokenizer_without_template_gets_the_builtin_chatml(qwen3_tokenizer, tmp_path):
    qwen3_tokenizer.save_pretrained(tmp_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / name).unlink(missing_ok=True)
    import json

    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.chat_template == builtin_template("chatml_reasoning")
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "r"},
                                      {"role": "user", "content": "q2"},
                                      {"role": "assistant", "content": "b", "reasoning": "s"}]})
    texts = render_texts(conv, tok)
    assert texts[0][2] == "<think>\nr\n</think>\n\na<|im_end|>\n"
    assert "<think>" not in texts[1][1]  # the built-in template drops earlier reasoning


def test_missing_tokenizer_path_is_a_clear_error():
    from onepass.render.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="not a local path and the hub is offline"):
        load_tokenizer("no/such-model-here")


def test_bundled_sample_views_equal_the_template_rendering(qwen3_tokenizer):
    from onepass.data.mathchat import load_sample

    tok = qwen3_tokenizer
    for conv in load_sample(limit=20):
        for v in render_views(conv, tok):
            prompt = tok.apply_chat_template(template_messages(conv, v.turn), tokenize=False,
                                             add_generation_prompt=True)
            full = tok.apply_chat_template(template_messages(conv, v.turn + 1), tokenize=False)
            assert v.tokens.tolist() == encode(tok, prompt) + encode(tok, full[len(prompt):])
            assert not v.boundary_merge


# Raises for a turn whose content is "boom" (as Cohere2 raises for roles it does not expect).
RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m.content == 'boom' %}\n"
    "{{ raise_exception('no boom here') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_turn_that_cannot_be_split_is_skipped_alone_and_the_other_views_kept(with_template):
    tok = with_template(NO_REASONING_TEMPLATE)  # renders no reasoning: turn 1 (with reasoning) cannot be kept
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "why"},
                                      {"role": "user", "content": "q2"},
                                      {"role": "assistant", "content": "b"}]}, source="x.jsonl", index=3)
    rendered = render_conversation(conv, tok)
    assert [v.turn for v in rendered.views] == [3]
    (error,) = rendered.skipped
    assert error.reason == "template" and str(error).startswith("x.jsonl record 3, message 1: ")
    rows, stats = prepare([conv], tok)
    assert (stats.views, stats.views_trained, stats.views_skipped, stats.conversations_used) == (2, 1, 1, 1)
    assert stats.skipped_by_reason == {"template": 1} and len(rows) == 1
    with pytest.raises(RenderError, match="message 1"):
        prepare([conv], tok, strict=True)


def test_a_template_that_raises_is_a_counted_skip_naming_record_turn_line_and_message(with_template):
    tok = with_template(RAISING_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "q2"},
                                      {"role": "assistant", "content": "boom"}]}, source="x.jsonl", index=5)
    rendered = render_conversation(conv, tok)
    assert [v.turn for v in rendered.views] == [1]
    (error,) = rendered.skipped
    assert isinstance(error, TemplateRaised) and error.reason == "template error"
    assert str(error) == ("x.jsonl record 5, message 3: the chat template raised at line 2 rendering the "
                          "conversation: TemplateError: no boom here")
    _, stats = prepare([conv], tok)
    assert stats.skipped_by_reason == {"template error": 1} and stats.views_trained == 1
    with pytest.raises(TemplateRaised):
        render_views(conv, tok)


def test_a_bug_outside_the_template_keeps_its_traceback(with_template, monkeypatch):
    tok = with_template(NO_REASONING_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})

    def broken(*args, **kwargs):
        raise ZeroDivisionError("not the template's")

    monkeypatch.setattr(tok, "apply_chat_template", broken)
    with pytest.raises(ZeroDivisionError):
        render_conversation(conv, tok)


def test_a_template_that_does_not_compile_is_one_line(tmp_path):
    from onepass.render.tokenizer import TokenizerError, check_template

    with pytest.raises(TokenizerError, match=r"^the chat template of bad.jinja does not compile: line 2: "):
        check_template("ok\n{% if %}\n", "bad.jinja")
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}\n{{ m.content }\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=rf"^the chat template of {path} does not compile: line 2: "):
        load_tokenizer("builtin:qwen3", chat_template=str(path))


def test_tool_call_arguments_go_as_a_json_string_to_a_template_that_concatenates_them(with_template):
    tok = with_template(  # as DeepSeek-V3: arguments + text, a dict would raise
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name + ' ' + c.function.arguments }}"
        "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ((_, _, completion),) = render_texts(CHAIN_NO_REASONING, tok)
    assert completion == '<tool_call>calc {"expr": "17*23"}</tool_call><|im_end|>\n'
    assert template_fields(tok, {}).arguments == "json"
    tok.chat_template = builtin_template("qwen3")
    assert template_fields(tok, {}).arguments == "dict"  # Qwen3: tojson


def test_reasoning_goes_under_the_key_the_template_reads(with_template):
    tok = with_template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning %}<think>{{ m.reasoning }}</think>"
        "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning_content": "why"}]})
    ((_, _, completion),) = render_texts(conv, tok)
    assert completion == "<think>why</think>a<|im_end|>\n"


def test_a_completion_format_without_tool_calls_does_not_drop_a_tool_call_silently(qwen3_tokenizer):
    fmt = "<think>\n{reasoning}\n</think>\n\n{content}{eos}"
    rendered = render_conversation(CHAIN, qwen3_tokenizer, RenderConfig(completion_format=fmt))
    (error,) = rendered.skipped
    assert "message 1: the completion format has no {tool_calls} field" in str(error)
    assert [v.turn for v in rendered.views] == [3, 5]


def test_named_formats_train_tool_calls_as_the_template_renders_them(qwen3_tokenizer):
    """think-tags has {tool_calls}: filled with the template's own tool-call text and end of turn."""
    ((_, _, completion), *_) = render_texts(CHAIN, qwen3_tokenizer, RenderConfig(completion_format="think-tags"))
    full = qwen3_tokenizer.apply_chat_template(template_messages(CHAIN, 2), tokenize=False)
    calls = full[full.index("<tool_call>"):]  # the template's own "<tool_call>...<|im_end|>\n" (no "\n": no content)
    assert completion == "<think>\ncall the tool\n</think>\n\n" + calls


def test_skips_number_messages_as_record_errors_do(with_template):
    """One numbering (Conversation.at): a leading system message is message 0 in both a parse error and a skip."""
    tok = with_template(RAISING_TEMPLATE)
    system = {"role": "system", "content": "s"}
    with pytest.raises(ConversationError, match="x.jsonl record 5, message 2: tool message without"):
        parse_record({"messages": [system, {"role": "user", "content": "q"}, {"role": "tool", "content": "t"}]},
                     source="x.jsonl", index=5)
    conv = parse_record({"messages": [system, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "boom"}]}, source="x.jsonl", index=5)
    (error,) = render_conversation(conv, tok).skipped
    assert str(error).startswith("x.jsonl record 5, message 2: ") and conv.at(1) == "x.jsonl record 5, message 2"
    field = parse_record({"system": "s", "messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": "boom"}]})
    assert field.at(1).endswith("message 1")  # a system *field* is not in the record's list


def test_reasoning_drop_trains_a_turn_the_template_never_renders_reasoning_for(with_template):
    """--reasoning drop: the turn as the non-thinking model generates it (the template's own rendering without
    the reasoning), counted; without the option, the skip names the option; a thinking template is unchanged."""
    tok = with_template(NO_REASONING_TEMPLATE)
    conv = parse_record({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "why"}]})
    with pytest.raises(RenderError, match=r"--reasoning drop"):
        render_views(conv, tok)
    (view,) = render_views(conv, tok, RenderConfig(reasoning="drop"))
    assert view.provenance.reasoning_dropped and tok.decode(view.tokens[view.num_prompt:]) == "a<|im_end|>\n"
    _, stats = prepare([conv], tok, PrepareConfig(reasoning="drop"))
    assert (stats.views_trained, stats.provenance["reasoning_dropped"], stats.reasoning) == (1, 1, "drop")
    assert "reasoning left out: 1 views by --reasoning drop" in stats.summary()
    with pytest.raises(UsageError, match="--reasoning must be one of keep, drop"):
        RenderConfig(reasoning="strip")


def test_reasoning_drop_changes_nothing_where_the_template_renders_reasoning(qwen3_tokenizer):
    keep = render_views(CHAIN, qwen3_tokenizer)
    drop = render_views(CHAIN, qwen3_tokenizer, RenderConfig(reasoning="drop"))
    assert [v.tokens.tolist() for v in keep] == [v.tokens.tolist() for v in drop]
    assert not any(v.provenance.reasoning_dropped for v in drop)
