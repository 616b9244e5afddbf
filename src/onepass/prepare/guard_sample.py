"""Which conversations the exactness guard checks: two of the run's own, as the run rendered them.

Why this module exists: the guard (:mod:`onepass.guard.check`) proves one-pass exact on a tiny
twin of the model, on a few of the user's conversations. Those are the conversations the run has
already read and rendered: ``onepass train`` and ``OnePassTrainer`` offer each conversation's
rendering to a :class:`ViewSample` as they prepare it (:func:`onepass.prepare.pipeline.prepare_conversation`),
so nothing is read or rendered twice. The rule: the first ``num`` conversations with two or more
views (a tree needs two), each cut to its views of at most ``max_view_tokens`` tokens; a conversation
with a skipped turn is passed over (training counts it); one-view conversations only when there are
not enough others. Without conversations at hand (prepared rows), the bundled MathChat pair.

    >>> sample = ViewSample()
    >>> sample.offer(render_conversation(conversation, tokenizer))      # doctest: +SKIP
    >>> sample.views()                                                  # doctest: +SKIP

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from onepass.data.mathchat import load_sample
from onepass.render import RenderConfig, Rendered, render_conversation
from onepass.render.tokenizer import load_tokenizer
from onepass.layout.view import View

MAX_VIEW_TOKENS = 2048  # a conversation's later views are left out of the check beyond this
GUARD_CONVERSATIONS = 32  # the guard looks at the first conversations only


def usable_views(rendered: Rendered, max_view_tokens: int = MAX_VIEW_TOKENS) -> list[View] | None:
    """A conversation's views the guard may check (its tokenized views of at most ``max_view_tokens``), or
    None when a turn of it was skipped: the check takes a conversation whole."""
    if rendered.skipped:
        return None
    return [v for v in rendered.views if isinstance(v, View) and len(v) <= max_view_tokens]


@dataclass(kw_only=True)
class ViewSample:
    """The guard's views, taken from conversations offered in order (see the module docstring)."""

    num: int = 2
    limit: int = GUARD_CONVERSATIONS  # conversations offered after the first ``limit`` are not looked at
    max_view_tokens: int = MAX_VIEW_TOKENS
    offered: int = 0
    multi: list[list[View]] = field(default_factory=list)
    single: list[list[View]] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return len(self.multi) >= self.num or self.offered >= self.limit

    def offer(self, rendered: Rendered) -> None:
        self.add(usable_views(rendered, self.max_view_tokens))

    def add(self, views: list[View] | None) -> None:
        """One conversation's :func:`usable_views` (computed where it was rendered: a worker)."""
        if self.full:
            return
        self.offered += 1
        if views is not None and len(views) >= 2:
            self.multi.append(views)
        elif views:
            self.single.append(views)

    def views(self) -> list[list[View]]:
        return (self.multi + self.single)[:self.num]


def sample_views(conversations: Iterable[Any], tokenizer: Any, render: RenderConfig | None = None, *,
                 num: int = 2, max_view_tokens: int = MAX_VIEW_TOKENS) -> list[list[View]]:
    """:class:`ViewSample` of ``conversations`` rendered here (conversations no run has rendered: the
    bundled pair, ``OnePassTrainer``'s ``exactness_conversations``); rendering stops once it is full."""
    sample = ViewSample(num=num, max_view_tokens=max_view_tokens, limit=10**9)
    for conv in conversations:
        if sample.full:
            break
        sample.offer(render_conversation(conv, tokenizer, render or RenderConfig()))
    return sample.views()


def builtin_conversations(limit: int = 16) -> list[Any]:
    """The first bundled MathChat conversations: the check's data when the user's are not at hand."""
    return load_sample(limit=limit)


def views_for_check(conversations: Sequence[Any], tokenizer: Any | None, render: RenderConfig | None = None,
                    *, source: str = "the data", empty: str = "no conversations at hand",
                    sampled: Sequence[list[View]] | None = None) -> tuple[list[list[View]], str]:
    """The views the guard checks, and what they are: ``sampled`` (a run's :meth:`ViewSample.views`), else
    two of ``conversations`` rendered with ``tokenizer``; else the bundled MathChat pair rendered with it;
    else with builtin:qwen3 (the twin's vocabulary is compacted, so any tokenizer exercises the same
    layers). ``empty``: why there are no conversations (said in the description)."""
    views = list(sampled) if sampled is not None else (
        sample_views(conversations, tokenizer, render) if conversations and tokenizer is not None else [])
    if views:
        return views, f"{len(views)} conversations of {source}"
    why = f"no usable conversation in {source}" if sampled is not None or conversations else empty
    if tokenizer is not None:
        views = sample_views(builtin_conversations(), tokenizer, render)
        if views:
            return views, f"the bundled MathChat pair ({why})"
    views = sample_views(builtin_conversations(), load_tokenizer("builtin:qwen3"))
    return views, f"the bundled MathChat pair rendered with builtin:qwen3 ({why})"
