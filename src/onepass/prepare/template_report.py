"""``onepass templates check``: how well a chat template splits the user's conversations into views.

Why this module exists: whether a template is exact for onepass is a property of the template
*and* the data (a tool-call turn with both content and thinking makes gpt-oss raise; a turn with
empty reasoning renders differently in Nemotron 3). Before preparing a corpus, a user wants to
know, for their template and their data: how many views the template splits cleanly, how many
are skipped and why, and whether reasoning is trained on each kind of turn. ``prepare`` prints
the same split/skip counts (:meth:`onepass.prepare.pipeline.PrepareStats.summary`).

Example::

    $ onepass templates check --tokenizer builtin:qwen3 --chat-template gptoss.jinja
    template gptoss.jinja (tool-call arguments: dict, reasoning field: reasoning_content)
    conversations 6 (6 with a kept view); views 12: 8 split cleanly, 1 use a derived format, 3 skipped
      reasoning left out: 0 by --reasoning drop, 1 where the template drops an earlier turn's
    ...

Without ``--data`` it checks :data:`TOOL_CHAIN_RECORDS`, six small tool-chain conversations.
No torch here: this is pure data.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from onepass.conversation.parse import Conversation, parse_record
from onepass.data.sources import load_conversations
from onepass.data.sources import limit_arg
from onepass.prepare.config import RENDER_KEYS, add_data_arguments, data_config_from_args
from onepass.render import RenderConfig, render_conversation
from onepass.render.fields import TemplateFields, template_fields
from onepass.render.tokenizer import load_tokenizer
from onepass.layout.view import count_provenance

_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


def _call(name: str, args: dict[str, Any], i: int) -> dict[str, Any]:
    """An OpenAI-style tool call: arguments as a JSON string."""
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


TOOL_CHAIN_RECORDS: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "reasoning_content": "2+2=4", "content": "4"}]},
    {"tools": [_WEATHER], "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
         "tool_calls": [_call("get_weather", {"city": "Paris"}, 0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"},
        {"role": "assistant", "reasoning_content": "It is 21.", "content": "21 degrees in Paris."}]},
    {"tools": [_WEATHER, _CALC], "messages": [
        {"role": "user", "content": "Paris minus Oslo temperature?"},
        {"role": "assistant", "reasoning_content": "Two calls.", "content": "Checking both.",
         "tool_calls": [_call("get_weather", {"city": "Paris"}, 0), _call("get_weather", {"city": "Oslo"}, 1)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "21"},
        {"role": "tool", "tool_call_id": "call_1", "content": "9"},
        {"role": "assistant", "reasoning_content": "Subtract.", "content": "",
         "tool_calls": [_call("calc", {"expr": "21-9"}, 2)]},
        {"role": "tool", "tool_call_id": "call_2", "content": "12"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "12 degrees warmer."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "reasoning_content": "Polite.", "content": "You are welcome."}]},
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "reasoning_content": "", "content": "Hi."},
                  {"role": "user", "content": "Again."},
                  {"role": "assistant", "content": "<think>\nrepeat\n</think>\n\nHi again."}]},
    {"messages": [{"role": "system", "content": "Réponds brièvement."},
                  {"role": "user", "content": "你好，天气怎么样？ مرحبا 🌤"},
                  {"role": "assistant", "reasoning_content": "用户问天气。", "content": "晴天 ☀️"}]},
    {"tools": [_CALC], "messages": [
        {"role": "user", "content": "17*23?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("calc", {"expr": "17*23"}, 0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "391"},
        {"role": "assistant", "reasoning_content": "Tool says 391.", "content": "391"}]},
)
"""System prompt, tools, two calls in one turn, a chain of calls, empty and inline reasoning,
multilingual text: 6 conversations, 12 assistant turns."""

KINDS = ("tool-call turn", "answer after a tool result", "answer after a user message")


def tool_chain_conversations() -> list[Conversation]:
    return [parse_record(r, source="tool-chain sample", index=i) for i, r in enumerate(TOOL_CHAIN_RECORDS)]


def turn_kind(conv: Conversation, k: int) -> str:
    """Which of :data:`KINDS` assistant message ``k`` is."""
    if conv.messages[k].tool_calls:
        return KINDS[0]
    return KINDS[1] if k and conv.messages[k - 1].role == "tool" else KINDS[2]


@dataclass(kw_only=True)
class TemplateReport:
    """Counts for one template over some conversations. ``reasoning[kind] = (trained, with reasoning)``;
    ``provenance[flag]``: the views each :class:`~onepass.layout.view.Provenance` flag applied to."""

    name: str
    fields: TemplateFields
    tool_fields: TemplateFields | None = None  # for conversations with tools, where named templates pick another
    conversations: int = 0
    conversations_kept: int = 0
    views: int = 0
    views_split: int = 0
    views_formatted: int = 0  # built from a --completion-format (then nothing is split by the template)
    provenance: dict[str, int] = field(default_factory=lambda: count_provenance(()))  # views per Provenance flag
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    first_skip: dict[str, str] = field(default_factory=dict)
    reasoning: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in KINDS})

    @property
    def views_skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    def lines(self) -> list[str]:
        ids = "" if self.fields.tool_ids == "given" else f", tool-call ids: {self.fields.tool_ids}.NAME:IDX"
        out = [(f"template {self.name} (tool-call arguments: {self.fields.arguments}, "
                f"reasoning field: {self.fields.reasoning_key}{ids})"
                + ("" if self.tool_fields in (None, self.fields) else  # type: ignore[union-attr]
                   f"; with tools, the tokenizer's 'tool_use' template: arguments {self.tool_fields.arguments}, "
                   f"reasoning field {self.tool_fields.reasoning_key}"
                   + (", generation prompt always rendered (turns end at EOS)"
                      if self.tool_fields.generation_always else ""))),
               (f"conversations {self.conversations} ({self.conversations_kept} with a kept view); "
                f"views {self.views}: {self.views_split} split cleanly, {self.provenance['derived']} use a derived "
                f"format, " + (f"{self.views_formatted} from the completion format, " if self.views_formatted else "")
                + f"{self.views_skipped} skipped")]
        if self.provenance["reasoning_dropped"] or self.provenance["history_reasoning_dropped"]:
            out.append(f"  reasoning left out: {self.provenance['reasoning_dropped']} by --reasoning drop, "
                       f"{self.provenance['history_reasoning_dropped']} where the template drops an earlier turn's")
        for reason, n in sorted(self.skipped_by_reason.items()):
            out.append(f"  skipped ({reason}): {n}; first: {self.first_skip[reason]}")
        trained = ", ".join(f"{kind} {t}/{n}" for kind, (t, n) in self.reasoning.items() if n)
        out.append(f"reasoning trained on: {trained or 'no turn with reasoning'}")
        return out


def template_report(conversations: Iterable[Conversation], tokenizer: Any, config: RenderConfig | None = None,
                    *, name: str = "") -> TemplateReport:
    """Render every conversation (skips counted, nothing raised) and count what is kept."""
    config = config or RenderConfig()
    report = TemplateReport(name=name or "of the tokenizer",
                            fields=template_fields(tokenizer, config.kwargs()),
                            tool_fields=template_fields(tokenizer, config.kwargs(), tools=True))
    for conv in conversations:
        rendered = render_conversation(conv, tokenizer, config)
        report.conversations += 1
        report.conversations_kept += bool(rendered.views)
        report.views += len(rendered.views) + len(rendered.skipped)
        count_provenance(rendered.views, report.provenance)
        if config.completion_format:
            report.views_formatted += len(rendered.views)
        else:
            report.views_split += sum(not v.provenance.derived for v in rendered.views)
        for error in rendered.skipped:
            report.skipped_by_reason[error.reason] = report.skipped_by_reason.get(error.reason, 0) + 1
            report.first_skip.setdefault(error.reason, str(error))
        kept = {v.turn for v in rendered.views if not v.provenance.reasoning_dropped}
        for k, m in enumerate(conv.messages):
            if m.role == "assistant" and (m.reasoning or "").strip():
                counts = report.reasoning[turn_kind(conv, k)]
                counts[0] += k in kept  # a kept view's completion holds its reasoning (render checks it)
                counts[1] += 1
    return report


def add_parser(sub: Any) -> None:
    """Add ``templates check`` to ``onepass``'s subcommands."""
    p = sub.add_parser("templates", help="check how a chat template splits conversations into views")
    tsub = p.add_subparsers(dest="templates_command", required=True)
    c = tsub.add_parser("check", help="views split cleanly / skipped (and why) for a template and data")
    c.add_argument("--tokenizer", required=True, help="builtin:qwen3, a local directory or a hub id")
    c.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    c.add_argument("--data", help="conversations (any --data spec of onepass prepare); default: "
                                  "six built-in tool-chain conversations")
    c.add_argument("--limit", type=limit_arg, default=1000, help="check at most this many conversations")
    add_data_arguments(c, names=RENDER_KEYS)  # --completion-format, --reasoning, --template-kwarg
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = data_config_from_args(args, names=RENDER_KEYS).render  # a bad KEY=VALUE: one line, before any work
    tokenizer = load_tokenizer(args.tokenizer, chat_template=args.chat_template)  # compiles: before data
    if args.data:
        loaded = load_conversations(args.data, strict=False, limit=args.limit)
        conversations = loaded.conversations
        if loaded.skipped:
            print(f"{len(loaded.skipped)} invalid records skipped; first: {loaded.skipped[0]}")
    else:
        conversations = tool_chain_conversations()
    report = template_report(conversations, tokenizer, config, name=args.chat_template or args.tokenizer)
    print("\n".join(report.lines()))
    return 0
