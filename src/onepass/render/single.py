"""What a single rendering trains: the whole conversation through the template, every assistant turn a target.

Why this module exists: the usual way to fine-tune on multi-turn data (TRL's ``SFTTrainer`` with
``assistant_only_loss``, axolotl, LLaMA-Factory) renders a conversation once, with the model's own chat
template, and trains every assistant turn in it. A template that drops the reasoning of earlier turns
(Qwen3, DeepSeek-R1, most reasoning models) then trains turn ``k`` *as it appears in that rendering*,
not as the model generates it at inference (:mod:`onepass.render.views`: the template's prompt for
``messages[:k]`` followed by the turn). Per trained turn, from the template's own text:

- **without its reasoning**: the record's reasoning for turn ``k`` is not in the single rendering, so
  the turn is trained as an answer after an empty or missing reasoning block, which the model, whose
  generation prompt asks for reasoning, never produces at inference (fw-ai/cookbook #386: "still
  emit an empty <think></think> on ~50% of responses");
- **on unseen reasoning**: the rendering shows turn ``k`` an earlier turn's reasoning that the
  inference prompt of turn ``k`` does not hold (a template that keeps reasoning in the full
  conversation yet drops it from the prompt), so the turn is conditioned on text the model never sees;
- **reasoning tokens never trained**: the tokens of the reasoning of the turns trained without it
  (the reasoning tokenized alone).

The same three figures are counted for onepass's views (each turn in its own view, its prompt the
inference prompt): zero, but for ``--reasoning drop`` (the user's choice, counted) and the turns
onepass skips (a counted skip trains nothing, its reasoning tokens reported apart). Reasoning is
looked for as :func:`onepass.render.sources.reasoning_rendered` does (the record's text, stripped,
inside the rendered text); the inference prompt is :func:`onepass.render.render_prompt`, the prompt
``onepass eval`` renders.

Worked example (the Qwen3 rule: reasoning kept only after the last user message; r1, r2 reasoning)::

    single rendering   user q1 | assistant a1 | user q2 | assistant <think>r2</think> a2
    turn 1             trained as "a1" without r1 (the model generates "<think>r1</think> a1")
    turn 2             trained as at inference
    -> 1 turn without its reasoning, 0 on unseen reasoning, tokens(r1) reasoning tokens never trained

No torch here: this is pure data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.errors import ConfigError
from onepass.layout.view import View
from onepass.render.encode import encode_texts
from onepass.render.errors import RenderError
from onepass.render.fields import template_fields
from onepass.render.messages import template_messages
from onepass.render.template import render_turn
from onepass.render.views import RenderConfig, Rendered, render_prompt, trained_turns


@dataclass(frozen=True, kw_only=True, slots=True)
class SingleRendering:
    """The counts of one conversation (or, summed with :func:`add_counts`, of a data set): the single
    rendering's ``single_*`` against onepass's views ``onepass_*`` (see the module doc)."""

    conversations: int = 0  # rendered whole by the template
    conversations_not_rendered: int = 0  # the template raises for the whole conversation (TRL could not train it)
    turns: int = 0  # assistant turns the single rendering trains (the --train-turns selection), in those rendered
    turns_with_reasoning: int = 0  # of them, with reasoning in the record
    reasoning_tokens: int = 0  # of their reasoning, tokenized alone
    single_without_reasoning: int = 0  # trained turns the single rendering shows without their reasoning
    single_on_unseen_reasoning: int = 0  # trained turns shown earlier reasoning their inference prompt lacks
    single_missing_seen_reasoning: int = 0  # trained turns not shown earlier reasoning their inference prompt holds
    single_untrained_reasoning_tokens: int = 0  # reasoning tokens of the turns trained without it
    prompts_not_rendered: int = 0  # turns whose inference prompt the template raises for (unseen reasoning undecided)
    onepass_views: int = 0  # turns onepass trains, each in its own view
    onepass_without_reasoning: int = 0  # views trained without the turn's reasoning (--reasoning drop, counted)
    onepass_prompts_checked: int = 0  # views after earlier reasoning whose prompt was compared with the inference
    # prompt (check_prompts)
    onepass_on_unseen_reasoning: int = 0  # of them, whose prompt holds reasoning the inference prompt lacks
    onepass_missing_seen_reasoning: int = 0  # of them, whose prompt lacks reasoning the inference prompt holds
    onepass_untrained_reasoning_tokens: int = 0  # reasoning tokens of views trained without it
    onepass_skipped_turns: int = 0  # selected turns onepass gives no view (counted skips: template, budget)
    onepass_skipped_reasoning_tokens: int = 0  # reasoning tokens of those turns

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """The single rendering's figures against onepass's, in two lines."""
        if not self.conversations and not self.conversations_not_rendered:
            return ""
        share = f" ({self.single_untrained_reasoning_tokens / self.reasoning_tokens:.0%})" if self.reasoning_tokens else ""
        lines = [f"single rendering (one per conversation, every assistant turn a target): of {self.turns:,} turns "
                 f"({self.turns_with_reasoning:,} with reasoning) {self.single_without_reasoning:,} trained without "
                 f"their reasoning, {self.single_on_unseen_reasoning:,} after earlier reasoning unseen at inference, "
                 f"{self.single_missing_seen_reasoning:,} without earlier reasoning seen at inference; "
                 f"{self.single_untrained_reasoning_tokens:,} of {self.reasoning_tokens:,} reasoning tokens{share} "
                 "never trained"
                 + (f"; {self.conversations_not_rendered:,} conversations the template cannot render whole"
                    if self.conversations_not_rendered else "")]
        checked = (f"{self.onepass_on_unseen_reasoning:,} after unseen / {self.onepass_missing_seen_reasoning:,} "
                   f"without seen reasoning ({self.onepass_prompts_checked:,} prompts checked against the inference "
                   "prompt), " if self.onepass_prompts_checked else "")
        skipped = (f"; {self.onepass_skipped_turns:,} turns skipped, counted ({self.onepass_skipped_reasoning_tokens:,} "
                   "reasoning tokens)" if self.onepass_skipped_turns else "")
        lines.append(f"  onepass views ({self.onepass_views:,} turns, each as at inference): "
                     f"{self.onepass_without_reasoning:,} without their reasoning, {checked}"
                     f"{self.onepass_untrained_reasoning_tokens:,} reasoning tokens untrained{skipped}")
        return "\n".join(lines)


def add_counts(total: Mapping[str, int], counts: SingleRendering | Mapping[str, int]) -> dict[str, int]:
    """``total`` plus ``counts``, field by field (the ``single_rendering`` section of ``stats.json``)."""
    more = counts.to_dict() if isinstance(counts, SingleRendering) else counts
    return {name: total.get(name, 0) + more.get(name, 0) for name in SINGLE_FIELDS}


SINGLE_FIELDS = tuple(f.name for f in dataclasses.fields(SingleRendering))


def single_rendering(conv: Conversation, tokenizer: Any, config: RenderConfig, rendered: Rendered, *,
                     template: str | None = None, check_prompts: bool = False,
                     max_tokens: int | None = None) -> SingleRendering:
    """The counts of ``conv``: its single rendering (every message, as TRL renders a record) against the views
    of ``rendered`` (:func:`onepass.render.render_conversation` with ``keep_texts``, the same ``config``).
    ``template``: the chat template of the single rendering (None: the tokenizer's own, which the views and
    the inference prompts always use), e.g. TRL's training template (:func:`trl_training_template`).

    The inference prompt of a turn is its view's prompt (the same messages, fields and call as
    :func:`~onepass.render.render_prompt`), else :func:`~onepass.render.render_prompt`'s; with ``check_prompts``
    it is always the latter, and each view's prompt is compared with it (``onepass_prompts_checked``): what
    ``onepass data stats`` does; ``prepare`` trusts the construction, one render a turn fewer. ``max_tokens``:
    the budget ``rendered`` was made under; a view over it is a skip (``prepare`` trains it not), whether it was
    tokenized or proven over without rendering (:mod:`onepass.render.preskip`): the counts are the same either way."""
    kwargs = config.kwargs()
    # one rendering has one tool list: where messages carry lists of their own (a tool added mid-conversation),
    # the one the conversation ends with, as a record of one ``tools`` column would hold it
    at_end = conv.at_turn(len(conv.messages) - 1)
    fields = template_fields(tokenizer, kwargs, tools=bool(at_end.tools))
    turns = trained_turns(conv, config)  # the turns the views train (the greeting only when asked)
    if not turns:
        return SingleRendering()
    whole_kwargs = {**kwargs, "chat_template": template} if template is not None else kwargs
    try:
        whole = render_turn(tokenizer, at_end, template_messages(at_end, None, **fields.message_options),
                            generation=False, kwargs=whole_kwargs, turn=turns[-1])
    except RenderError:
        return SingleRendering(conversations_not_rendered=1)
    reasoning = {k: (m.reasoning or "").strip() for k, m in enumerate(conv.messages) if m.role == "assistant"}
    texts = {turn: (prompt, completion) for turn, prompt, completion in rendered.texts}
    viewed = {v.turn for v in rendered.views if isinstance(v, View) and (max_tokens is None or len(v) <= max_tokens)}
    prompts: dict[int, str | None] = {}

    def inference_prompt(k: int) -> str | None:
        if k in texts and not check_prompts:
            return texts[k][0]
        if k not in prompts:
            try:
                prompts[k] = render_prompt(conv, tokenizer, k, kwargs)
            except RenderError:
                prompts[k] = None
        return prompts[k]

    def context(k: int, text: str) -> tuple[bool, bool] | None:
        """Does ``text`` (what turn ``k`` is trained after) show an earlier turn's reasoning its inference prompt
        lacks, and lack one the prompt shows? None: the template cannot render the inference prompt."""
        earlier = [r for j, r in reasoning.items() if j < k and r]
        if not earlier:
            return False, False
        prompt = inference_prompt(k)
        if prompt is None:
            return None
        return (any(r in text and r not in prompt for r in earlier),
                any(r not in text and r in prompt for r in earlier))

    with_reasoning = [k for k in turns if reasoning[k]]
    ids = encode_texts(tokenizer, [reasoning[k] for k in with_reasoning]) if with_reasoning else []
    tokens = dict(zip(with_reasoning, map(len, ids)))
    out: dict[str, int] = dict.fromkeys(SINGLE_FIELDS, 0)
    out.update(conversations=1, turns=len(turns), turns_with_reasoning=len(with_reasoning),
               reasoning_tokens=sum(tokens.values()))
    for k in turns:
        r = reasoning[k]
        if r and r not in whole:
            out["single_without_reasoning"] += 1
            out["single_untrained_reasoning_tokens"] += tokens[k]
        verdict = context(k, whole)
        if verdict is None:
            out["prompts_not_rendered"] += 1
        else:
            out["single_on_unseen_reasoning"] += verdict[0]
            out["single_missing_seen_reasoning"] += verdict[1]
        if k not in viewed:
            out["onepass_skipped_turns"] += 1
            out["onepass_skipped_reasoning_tokens"] += tokens.get(k, 0)
            continue
        prompt, completion = texts[k]
        out["onepass_views"] += 1
        if r and r not in completion:
            out["onepass_without_reasoning"] += 1
            out["onepass_untrained_reasoning_tokens"] += tokens[k]
        if check_prompts and any(r for j, r in reasoning.items() if j < k) and (mine := context(k, prompt)) is not None:
            out["onepass_prompts_checked"] += 1
            out["onepass_on_unseen_reasoning"] += mine[0]
            out["onepass_missing_seen_reasoning"] += mine[1]
    return SingleRendering(**out)


def sum_counts(items: Iterable[SingleRendering]) -> SingleRendering:
    """The counts of many conversations, summed."""
    total: dict[str, int] = {}
    for item in items:
        total = add_counts(total, item)
    return SingleRendering(**total) if total else SingleRendering()


def trl_training_template(tokenizer: Any) -> str:
    """The template TRL's ``SFTTrainer`` renders a conversation with under ``assistant_only_loss=True``: its
    training variant of the tokenizer's template (``trl.get_training_chat_template``: generation markers and,
    for Qwen3 and others, every turn's reasoning kept), or the tokenizer's own where TRL needs no patch."""
    try:
        from trl import get_training_chat_template
    except ImportError:
        raise ConfigError("the single rendering with TRL's training template needs trl >= 1.7 with "
                          "get_training_chat_template: pip install 'onepass[bench]'") from None
    try:
        template = get_training_chat_template(tokenizer)
    except ValueError as e:
        raise ConfigError(f"TRL has no training template for this chat template ({str(e).splitlines()[0]})") from None
    own = tokenizer.chat_template
    return template if template is not None else (own["default"] if isinstance(own, dict) else own)
