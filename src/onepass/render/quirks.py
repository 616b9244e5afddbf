"""Template quirks: every way a real chat template departs from "the completion is the rest", as data.

Why this module exists: onepass renders every view with the model's own template, so what one
model's template does differently (Kimi-K2 dropping a final answer's reasoning, gpt-oss's
``developer`` role, Command R7B's ``tool_plan``) must be *found* on the template in front of us,
never assumed from a model's name. The rendering code (:mod:`onepass.render.views` and its rooms)
therefore holds no model names in its branches: it probes fields (:mod:`onepass.render.fields`),
tries its completion sources in order (:mod:`onepass.render.sources`) and retries a skipped turn
(:data:`onepass.render.views.RETRIES`). Which real template needs which of those paths, and the
test that proves each, is this table, :data:`QUIRKS`.

Each :class:`Quirk` has a ``probe``: a function of a tokenizer that runs onepass's own probes or
pipeline on a tiny conversation and says whether the template shows the quirk. ``tests/render/test_quirks.py``
runs every probe on every vendored template (``tests/fixtures/chat_templates``) and checks it fires
on exactly the ones listed in ``templates``: a template update that changes a quirk fails loudly,
and so does a quirk whose proving test (``proved_by``) was renamed away. ``docs/templates.md``
("Template quirks") is :func:`quirks_markdown` of this table, checked by the same test.

Example: the Kimi-K2-Thinking template renders a final answer's reasoning as ``<think></think>``,
so its view is derived (:mod:`onepass.render.derived`) while Qwen3 splits it as it is::

    Qwen3    full = prompt + "<think>\\nr\\n</think>\\n\\na<|im_end|>\\n"            (template split)
    Kimi-K2  full = prompt + "<think></think>a<|im_end|>"  ->  "<think>r</think>a<|im_end|>"  (derived)

Add a quirk (a template that departs from the plain split in a way no row names yet): one
:class:`Quirk` row of :data:`QUIRKS`: what the template does (a tiny rendered example), how onepass
finds it (a ``probe`` of the template, never a model name), what it does about it and ``where`` (the
function), the vendored templates that show it (the file in ``tests/fixtures/chat_templates``, its
source in ``SOURCES.md``) and ``proved_by``, the test that proves the handling; then regenerate
``docs/templates.md`` with ``python -m onepass.render.quirks docs/templates.md``.
``tests/render/test_quirks.py`` runs every probe on every vendored template and checks both.

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onepass.conversation.parse import Conversation, Message, ToolCall
from onepass.render.derived import CONTENT
from onepass.render.errors import RenderError, UnopenedReasoning
from onepass.render.fields import TemplateFields, template_fields
from onepass.render.template import prober
from onepass.render.views import RenderConfig, render_conversation, render_prompt
from onepass.render.messages import template_messages
from onepass.layout.view import View

THINKING = {"thinking": True}  # DeepSeek-V3.1's switch to thinking (other templates ignore it)
Probe = Callable[[Any], bool]  # a tokenizer (with its chat template) -> does the template show the quirk?


@dataclass(frozen=True, kw_only=True, slots=True)
class Quirk:
    """One way a chat template departs from the plain split, how onepass finds it and what it does."""

    name: str
    does: str  # what the template does, with a tiny rendered example
    detected_by: str  # how onepass finds it on the template (a probe, never a model name)
    handled_by: str  # what onepass does about it
    where: str  # the onepass function that holds the handling (module.name, resolved by tests/render/test_quirks.py)
    probe: Probe  # True where the template shows the quirk (run on every vendored template by the test)
    templates: tuple[str, ...]  # vendored templates (tests/fixtures/chat_templates) known to show it
    proved_by: str  # the pytest node id of the test that proves the handling


# --- the probe conversations: tiny, one concept each -------------------------------------------------

_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}}}}}


def _call(i: int = 0) -> ToolCall:
    return ToolCall(name="get_weather", arguments={"city": "Paris"}, id=f"call_{i}", text='{"city": "Paris"}')


def _answer(reasoning: str | None) -> Conversation:
    """``user, assistant``: one final answer with this reasoning."""
    return Conversation(messages=(Message(role="user", content="What is 2+2?"),
                                  Message(role="assistant", content="It is 4.", reasoning=reasoning)),
                        source="quirk probe")


def _chain(*, answer_reasoning: str = "It said sunny.", calls: int = 1, content: str = "") -> Conversation:
    """``user, assistant (tool calls), tool..., assistant (answer)``, with tools."""
    results = tuple(Message(role="tool", content="sunny", tool_call_id=f"call_{i}") for i in range(calls))
    return Conversation(messages=(
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content=content, reasoning="Need the tool.",
                tool_calls=tuple(_call(i) for i in range(calls))),
        *results,
        Message(role="assistant", content="Sunny in Paris.", reasoning=answer_reasoning)),
        tools=(_TOOL,), source="quirk probe")


def _two_questions() -> Conversation:
    """``user, assistant, user, assistant``, each answer with its own reasoning."""
    return Conversation(messages=(
        Message(role="user", content="What is 2+2?"),
        Message(role="assistant", content="It is 4.", reasoning="FIRSTxREASONING"),
        Message(role="user", content="And 3+3?"),
        Message(role="assistant", content="It is 6.", reasoning="Add three.")), source="quirk probe")


def _after_final_answer() -> Conversation:
    """A tool-call turn with both content and reasoning, its answer, then a second question and answer."""
    chain = _chain(content="Checking the weather.")
    return Conversation(messages=(*chain.messages, Message(role="user", content="Thanks. And tomorrow?"),
                                  Message(role="assistant", content="Also sunny.", reasoning="Same forecast.")),
                        tools=chain.tools, source="quirk probe")


def _turn(tokenizer: Any, conv: Conversation, turn: int, config: RenderConfig = RenderConfig()
          ) -> View | RenderError:
    """Turn ``turn``'s view, or the error that skips it."""
    rendered = render_conversation(conv, tokenizer, config)
    view = next((v for v in rendered.views if isinstance(v, View) and v.turn == turn), None)
    return view if view is not None else next(e for e in rendered.skipped if f"message {turn}:" in str(e))


def _fields(tokenizer: Any, *, tools: bool = False) -> TemplateFields:
    return template_fields(tokenizer, {}, tools=tools)


def _completion(tokenizer: Any, view: View | RenderError) -> str:
    return tokenizer.decode(view.tokens[view.num_prompt:].tolist()) if isinstance(view, View) else ""


# --- the probes ----------------------------------------------------------------------------------------

def _final_answer_reasoning_dropped(tokenizer: Any) -> bool:
    view = _turn(tokenizer, _answer("Add them."), 1)
    return isinstance(view, View) and view.provenance.derived and "Add them." in _completion(tokenizer, view)


def _empty_think_prompt(tokenizer: Any) -> bool:
    view = _turn(tokenizer, _answer(""), 1)
    return isinstance(view, View) and view.provenance.derived


def _history_changes_after_final_answer(tokenizer: Any) -> bool:
    conv = _chain()
    view, render = _turn(tokenizer, conv, 3), prober(tokenizer, conv, {}, 3)
    messages = template_messages(conv, 4, **_fields(tokenizer, tools=True).message_options)
    history, full = render(messages[:3], False), render(messages, False)
    return (isinstance(view, View) and view.provenance.derived and None not in (history, full)
            and not full.startswith(history))


def _history_reasoning_retry(tokenizer: Any) -> bool:
    view = _turn(tokenizer, _after_final_answer(), 5)
    return isinstance(view, View) and view.provenance.history_reasoning_dropped


def _reasoning_never_rendered(tokenizer: Any) -> bool:
    kept = _turn(tokenizer, _answer("Add them."), 1)
    dropped = _turn(tokenizer, _answer("Add them."), 1, RenderConfig(reasoning="drop"))
    return isinstance(kept, RenderError) and isinstance(dropped, View) and dropped.provenance.reasoning_dropped


def _r1_generation_prompt(tokenizer: Any) -> bool:
    skipped = _turn(tokenizer, _answer("Add them."), 1)
    given = _turn(tokenizer, _answer("Add them."), 1, RenderConfig(completion_format="deepseek-r1"))
    return (isinstance(skipped, RenderError) and "--completion-format deepseek-r1" in str(skipped)
            and isinstance(given, View))


def _unopened_after_tool(tokenizer: Any) -> bool:
    config, conv = RenderConfig(completion_format="deepseek-r1", template_kwargs=THINKING), _chain()
    return isinstance(_turn(tokenizer, conv, 1, config), View) and isinstance(_turn(tokenizer, conv, 3, config),
                                                                              UnopenedReasoning)


def _old_reasoning_dropped(tokenizer: Any) -> bool:
    first = _turn(tokenizer, _two_questions(), 1)
    return (isinstance(first, View) and "FIRSTxREASONING" in _completion(tokenizer, first)
            and "FIRSTxREASONING" not in render_prompt(_two_questions(), tokenizer, 3))


def _one_call_per_name(tokenizer: Any) -> bool:
    skipped = _turn(tokenizer, _chain(calls=2), 1)
    return isinstance(skipped, RenderError) and "2 tool call(s) 'get_weather' (found 1)" in str(skipped)


def _empty_content_changes_what_follows(tokenizer: Any) -> bool:
    conv = _chain()
    render = prober(tokenizer, conv, {}, 1)
    messages = template_messages(conv, 2, **_fields(tokenizer, tools=True).message_options)
    with_content = render([*messages[:-1], {**messages[-1], "content": CONTENT}], False)
    empty = render(messages, False)
    if with_content is None or empty is None or with_content.count(CONTENT) != 1:
        return False
    head, after = with_content.split(CONTENT)
    return empty.startswith(head) and empty[len(head):] != after


def _calls_only_without_content(tokenizer: Any) -> bool:
    skipped = _turn(tokenizer, _chain(), 1, RenderConfig(completion_format="deepseek-r1"))
    return isinstance(skipped, RenderError) and "only when the content is None" in str(skipped)


QUIRKS: tuple[Quirk, ...] = (
    Quirk(name="old reasoning dropped",
          does="drops the reasoning of answers before the last user message from the history: turn 1 trains "
               "`<think>\\nr\\n</think>\\n\\nIt is 4.`, turn 3's prompt shows `<|im_start|>assistant\\nIt is 4.`",
          detected_by="nothing to detect: every view's prompt is the template's own rendering of messages[:k]",
          handled_by="each turn is its own view, so its reasoning is trained there and nowhere is it invented",
          where="onepass.render.sources.Turn.prompt", probe=_old_reasoning_dropped,
          templates=("glm4moe", "gptoss", "kimi_k2_thinking", "lfm2_2_5", "minimax_m2", "nemotron_3_nano",
                     "nemotron_3_super", "nemotron_3_ultra", "qwen3", "qwen3_5_think", "qwen3_6"),
          proved_by="tests/render/test_render.py::test_qwen3_keeps_reasoning_inside_the_tool_chain_and_drops_it_after"),
    Quirk(name="empty reasoning against a <think> generation prompt",
          does="the generation prompt opens `<think>\\n`, but a turn with empty reasoning renders "
               "`<think></think>It is 4.`, so the conversation does not start with the prompt",
          detected_by="the template split declines (no prefix); the derived format reads the turn off a probe "
                      "turn with sentinel reasoning rendered last",
          handled_by="trains `\\n</think>\\nIt is 4.<|im_end|>`: the format of a turn with reasoning, reasoning "
                     "empty (Provenance.derived, counted)",
          where="onepass.render.derived.derive_completion", probe=_empty_think_prompt,
          templates=("minimax_m2", "nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra"),
          proved_by="tests/render/test_generation_format.py::"
                    "test_an_empty_reasoning_the_template_renders_apart_is_trained_as_generated"),
    Quirk(name="final answer reasoning dropped",
          does="renders a final answer `<think></think>It is 4.`, its reasoning dropped even as the last turn, "
               "while a tool-call turn in the same place keeps `<think>R</think>`",
          detected_by="the template split declines with ReasoningNotRendered; the derived format finds the "
                      "emptied block and reads the full one off a probe tool-call turn",
          handled_by="trains `<think>R</think>It is 4.<|im_end|>` (Provenance.derived, counted)",
          where="onepass.render.derived._reasoning_block", probe=_final_answer_reasoning_dropped,
          templates=("kimi_k2_thinking",),
          proved_by="tests/render/test_generation_format.py::"
                    "test_an_answer_whose_reasoning_the_template_drops_gets_the_block_of_a_tool_call_turn"),
    Quirk(name="history re-rendered once an answer follows",
          does="drops an earlier tool-call turn's analysis once a final answer follows, so `messages[:k+1]` "
               "does not start with `messages[:k]` (gpt-oss: `future_final_message`)",
          detected_by="the template split declines; the derived format looks for the generation prompt last "
                      "before the probe turn's sentinels, not at the prompt's length",
          handled_by="the prompt is the one the model sees (with the analysis), the completion the turn as "
                     "the template renders it last (Provenance.derived, counted)",
          where="onepass.render.derived.read_completion", probe=_history_changes_after_final_answer,
          templates=("gptoss", "kimi_k2_thinking"),
          proved_by="tests/render/test_generation_format.py::"
                    "test_a_history_rendered_differently_keeps_the_turn_as_the_template_renders_it"),
    Quirk(name="template raises for an earlier turn whose reasoning it drops",
          does="raises `Cannot pass both content and thinking` for a tool-call turn holding both, in every "
               "later prompt, yet drops that analysis once a final answer follows",
          detected_by="the turn raises (TemplateRaised); each earlier reasoning is replaced by its own sentinel "
                      "and one absent from both renderings is one the template drops there",
          handled_by="the retry `history reasoning dropped` (views.RETRIES) renders the turn without it "
                     "(Provenance.history_reasoning_dropped, counted); a probe that shows it keeps the skip",
          where="onepass.render.views._history_reasoning", probe=_history_reasoning_retry,
          templates=("gptoss",),
          proved_by="tests/test_real_templates.py::"
                    "test_history_reasoning_is_left_out_only_where_the_probe_shows_the_template_drops_it[gptoss]"),
    Quirk(name="reasoning never rendered",
          does="a non-thinking template renders `<|im_start|>assistant\\nIt is 4.<|im_end|>` whatever the "
               "turn's reasoning",
          detected_by="the reasoning is in neither the template split nor the derived format (ReasoningNotRendered)",
          handled_by="a counted skip; with `--reasoning drop` the retry `own reasoning dropped` trains the turn "
                     "without it, as the non-thinking model generates it (Provenance.reasoning_dropped)",
          where="onepass.render.views._own_reasoning", probe=_reasoning_never_rendered,
          templates=("cohere2", "cohere2_tool_use", "deepseekv3_1", "qwen3_instruct_2507"),
          proved_by="tests/render/test_render.py::test_reasoning_drop_trains_a_turn_the_template_never_renders_reasoning_for"),
    Quirk(name="R1-style generation prompt",
          does="the generation prompt ends `<｜Assistant｜><think>\\n` and a finished turn is rendered without "
               "any reasoning, so how the model closes `<think>` is never shown",
          detected_by="no derived format: the text the generation prompt opens is not in the finished turn "
                      "(the skip says `pass --completion-format deepseek-r1`)",
          handled_by="`--completion-format deepseek-r1` writes `r\\n</think>\\n\\nIt is 4.` with the template's "
                     "own tool calls and end of turn",
          where="onepass.render.derived._opener_hint", probe=_r1_generation_prompt,
          templates=("deepseek_r1_distill", "deepseekv3", "qwq_32b"),
          proved_by="tests/render/test_generation_format.py::"
                    "test_no_format_is_derived_where_the_template_never_shows_how_the_turn_is_closed"),
    Quirk(name="<think> not opened after a tool result",
          does="the generation prompt after a user message opens `<think>` (DeepSeek-V3.1: with `thinking=True`), "
               "after a tool result it opens nothing (`...<｜tool▁output▁end｜>`)",
          detected_by="the completion format closes `</think>` and the prompt has no open `<think>`",
          handled_by="that turn is a counted skip (UnopenedReasoning), never a target closing a tag never opened",
          where="onepass.render.formats.unopened_close", probe=_unopened_after_tool,
          templates=("deepseekv3", "deepseekv3_1"),
          proved_by="tests/conversation/test_record_schemas.py::"
                    "test_deepseek_v31_r1_format_after_a_tool_result_is_a_counted_skip_not_an_unopened_tag"),
    Quirk(name="arguments concatenated as a string",
          does="renders a tool call as `name + '\\n```json\\n' + arguments`: a dict raises `can only "
               "concatenate str (not \"dict\")`",
          detected_by="TemplateFields.arguments: a probe call rendered with dict, then JSON-string arguments",
          handled_by="arguments go over as a JSON string (the record's own string when it gave one)",
          where="onepass.render.messages.tool_call_dict", probe=lambda tok: _fields(tok).arguments == "json",
          templates=("deepseekv3", "deepseekv3_1"),
          proved_by="tests/render/test_render.py::"
                    "test_tool_call_arguments_go_as_a_json_string_to_a_template_that_concatenates_them"),
    Quirk(name="JSON-string arguments rendered verbatim",
          does="renders a string `arguments` as it is (Qwen3's `arguments is string` branch): "
               "`{\"city\":\"\\u5317\\u4eac\"}` stays those bytes",
          detected_by="TemplateFields.string_arguments: a JSON-string probe call rendered faithfully",
          handled_by="the record's own string goes over byte for byte, never re-serialised (else parsed, counted "
                     "in tool_arguments_parsed)",
          where="onepass.render.messages.tool_call_dict", probe=lambda tok: _fields(tok).string_arguments,
          templates=("deepseekv3", "deepseekv3_1", "kimi_k2_thinking", "qwen3", "qwen3_instruct_2507"),
          proved_by="tests/conversation/test_record_schemas.py::"
                    "test_a_json_string_argument_is_trained_byte_for_byte_where_the_template_renders_strings[qwen3]"),
    Quirk(name="tool calls rendered by their id",
          does="renders a call as `<|tool_call_begin|>{{ id }}`: an OpenAI id `call_0` hides the tool's name",
          detected_by="TemplateFields.tool_ids: the tool's name is rendered only with a functions.NAME:IDX id",
          handled_by="ids go over as `functions.get_weather:0` (IDX counts every call, as vLLM's Kimi-K2 parser "
                     "does), results follow their call",
          where="onepass.render.messages.functions_ids", probe=lambda tok: _fields(tok).tool_ids == "functions",
          templates=("kimi_k2_thinking",),
          proved_by="tests/test_real_templates.py::"
                    "test_the_probe_hands_fields_over_as_the_template_reads_them[kimi_k2_thinking]"),
    Quirk(name="reasoning as tool_plan",
          does="Command R7B's `tool_use` template renders `<|START_THINKING|>{{ tool_plan }}<|END_THINKING|>` on a "
               "tool-call turn only, and is picked by transformers when tools are passed",
          detected_by="TemplateFields.reasoning_key: no key rendered on an answer, `tool_plan` on a tool-call "
                      "turn (fields probed per named template, with tools)",
          handled_by="reasoning goes over as `tool_plan`; answers with reasoning are skips (`--reasoning drop`)",
          where="onepass.render.fields.probe_fields", probe=lambda tok: _fields(tok, tools=True).reasoning_key
          == "tool_plan", templates=("cohere2_tool_use",),
          proved_by="tests/test_real_templates.py::"
                    "test_named_templates_are_picked_per_conversation_as_transformers_does[cohere2_tool_use]"),
    Quirk(name="generation prompt after a finished conversation",
          does="appends `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>` to every rendering, asked for or not",
          detected_by="TemplateFields.generation_always: a probe rendered the same with and without "
                      "add_generation_prompt",
          handled_by="the completion is cut after the tokenizer's EOS (`<|END_OF_TURN_TOKEN|>`): the next "
                     "header is never trained",
          where="onepass.render.sources.turn_end", probe=lambda tok: _fields(tok, tools=True).generation_always,
          templates=("cohere2_tool_use",),
          proved_by="tests/test_real_templates.py::"
                    "test_named_templates_are_picked_per_conversation_as_transformers_does[cohere2_tool_use]"),
    Quirk(name="developer role",
          does="renders a leading `developer` message (`<|start|>developer<|message|># Instructions...`); "
               "Qwen3 would drop it silently",
          detected_by="TemplateFields.developer: a probe developer message rendered",
          handled_by="a record's developer prompt goes over as `developer` here, as `system` elsewhere",
          where="onepass.render.messages.template_messages", probe=lambda tok: _fields(tok).developer,
          templates=("gptoss", "kimi_k2_thinking", "lfm2_2_5", "nemotron_3_nano", "nemotron_3_super",
                     "nemotron_3_ultra", "seed_oss"),
          proved_by="tests/render/test_generation_format.py::"
                    "test_a_developer_prompt_goes_over_as_developer_where_the_template_renders_it"),
    Quirk(name="reasoning read from the content",
          does="reads no reasoning field: an assistant's content is rendered as it is, so a record's "
               "`<think>r</think>a` is shown whole (SmolLM3, non-thinking templates) or cut by the template "
               "itself (`content.split('</think>')`: QwQ, R1-Distill)",
          detected_by="TemplateFields.reads_reasoning: no key of TEMPLATE_REASONING_KEYS is rendered on an answer "
                      "or a tool-call turn",
          handled_by="a content the record gave with a leading `<think>` block goes over as given (its reasoning "
                     "is then trained where the template renders it; counted: `leading <think> block kept in the "
                     "content`); reasoning given in a field is still never rendered (a skip, `--reasoning drop`)",
          where="onepass.render.messages.message_dict", probe=lambda tok: not _fields(tok).reads_reasoning,
          templates=("cohere2", "cohere2_tool_use", "deepseek_r1_distill", "deepseekv3", "deepseekv3_1",
                     "qwen3_instruct_2507", "qwq_32b"),
          proved_by="tests/faults/test_template_faults.py::"
                    "test_an_inline_think_block_goes_over_as_given_where_the_template_reads_no_reasoning_field"),
    Quirk(name="reasoning under another key",
          does="reads reasoning from `thinking` or `reasoning` instead of `reasoning_content`",
          detected_by="TemplateFields.reasoning_key: the first key of TEMPLATE_REASONING_KEYS a probe renders",
          handled_by="reasoning goes over under that key (no vendored template needs it: gpt-oss and LFM2.5 "
                     "read `thinking`, which transformers fills from `reasoning_content`)",
          where="onepass.render.fields.probe_fields",
          probe=lambda tok: _fields(tok).reasoning_key in ("thinking", "reasoning"), templates=(),
          proved_by="tests/render/test_render.py::test_reasoning_goes_under_the_key_the_template_reads"),
    Quirk(name="one tool call per name",
          does="renders only a turn's first tool call: a second call to the same tool is not in the text",
          detected_by="the check tool_calls_rendered counts each tool's name in the completion",
          handled_by="a counted skip naming the calls found, never a turn trained without a call",
          where="onepass.render.sources.tool_calls_rendered", probe=_one_call_per_name, templates=("gptoss",),
          proved_by="tests/test_real_templates.py::"
                    "test_a_tool_call_the_template_does_not_render_is_a_skip_even_when_its_name_is[gptoss]"),
    Quirk(name="empty content changes what follows",
          does="the text after a turn's content depends on whether it is empty: `text\\n<tool_call>` after text, "
               "`<tool_call>` alone after none (Qwen3's `(loop.first and content) or not loop.first`)",
          detected_by="completion_fields renders the turn with a sentinel content, then with the empty content, "
                      "and reads what follows the content from the second",
          handled_by="a completion format's `{tool_calls}` is the template's own text for an empty content",
          where="onepass.render.formats.completion_fields", probe=_empty_content_changes_what_follows,
          templates=("glm4moe", "nemotron_3_nano", "nemotron_3_super", "qwen3", "qwen3_5_think", "qwen3_6",
                     "qwen3_instruct_2507", "qwq_32b", "seed_oss"),
          proved_by="tests/render/test_render.py::test_named_formats_train_tool_calls_as_the_template_renders_them"),
    Quirk(name="tool calls only for a None content",
          does="renders a turn's tool calls only `if message['content'] is none`; transformers drops None-valued "
               "keys from every message (at inference too), so the calls are never rendered",
          detected_by="with a completion format, the turn's tool-call names are not in what the template renders "
                      "after the content",
          handled_by="such a turn is a counted skip saying why (it cannot be trained with this template)",
          where="onepass.render.sources.given_format", probe=_calls_only_without_content,
          templates=("deepseek_r1_distill",),
          proved_by="tests/test_real_templates.py::"
                    "test_every_kept_view_is_the_templates_own_rendering[deepseek_r1_distill+deepseek-r1]"),
)


def quirks_markdown(quirks: tuple[Quirk, ...] = QUIRKS) -> str:
    """The table as the Markdown section of ``docs/templates.md`` (tests/render/test_quirks.py keeps them equal)."""
    lines = []
    for q in quirks:
        lines += [f"### {q.name}", "", f"- **The template:** {q.does}", f"- **Detected by:** {q.detected_by}",
                  f"- **onepass:** {q.handled_by} (`{q.where}`)",
                  f"- **Vendored templates showing it:** {', '.join(f'`{t}`' for t in q.templates) or 'none'}",
                  f"- **Proved by:** `{q.proved_by}`", ""]
    return "\n".join(lines)


DOCS_BEGIN = "<!-- quirks: begin (generated: onepass.render.quirks.quirks_markdown) -->"
DOCS_END = "<!-- quirks: end -->"


def with_quirks_section(text: str) -> str:
    """``text`` (docs/templates.md) with the part between :data:`DOCS_BEGIN` and :data:`DOCS_END` replaced
    by :func:`quirks_markdown`."""
    head, rest = text.split(DOCS_BEGIN, 1)
    return f"{head}{DOCS_BEGIN}\n\n{quirks_markdown()}\n{DOCS_END}{rest.split(DOCS_END, 1)[1]}"


if __name__ == "__main__":  # python -m onepass.render.quirks docs/templates.md: regenerate the docs section
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.write_text(with_quirks_section(path.read_text(encoding="utf-8")), encoding="utf-8")
