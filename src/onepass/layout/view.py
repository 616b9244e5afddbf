"""The view: one N-pass training example, the hand-off from rendering to the layout.

Why this module exists: everything after rendering (the prefix tree, the schedule, packing, the
loss, the guard, benchmarks, RL scoring) needs a view's tokens and where its prompt ends, never
how the template produced them. Keeping :class:`View` here, apart from :mod:`onepass.render`,
lets the layout modules (``tree``, ``schedule``, ``pack``, ``loss``) import no template code.

A view of assistant turn k is ``tokens = prompt_k + completion_k`` (each tokenized on its own):
``tokens[:num_prompt]`` is context, the rest is trained::

    >>> v = View(tokens=np.array([11, 12, 13, 14, 15]), num_prompt=3, turn=1, source="chat.jsonl line 4")
    >>> v.num_completion, len(v), v.at
    (2, 5, 'chat.jsonl line 4, message 1')

Each view carries its :class:`Provenance`: how its completion was found and what was left out of
it, one flag per way, each counted (``PrepareStats`` and ``onepass templates check`` derive their
``views_<flag>`` counts from its fields).

No torch here: this is pure data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from onepass.errors import message_at


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """How a view's completion was found, and what was left out of it: each flag is a way other than
    "the template's own split of the turn as the record gives it", and each is counted as ``views_<flag>``.

    Add a flag: one bool field here, set by the completion source or retry that applies it
    (:attr:`onepass.render.sources.CompletionSource.flag`, :attr:`onepass.render.views.Retry.flag`). The
    counts (``PrepareStats``, its parallel merge, ``stats.json``, ``onepass templates check``) follow by
    themselves (``tests/data/test_data_parallel.py`` runs the merge on every vendored template).
    """

    derived: bool = False  # completion from the generation format derived from the template (it cannot split it)
    reasoning_dropped: bool = False  # its own reasoning left out by choice (--reasoning drop)
    history_reasoning_dropped: bool = False  # an earlier message's reasoning the template drops here left out

    def flags(self) -> tuple[str, ...]:
        """The names of the flags set, in field order."""
        return tuple(name for name in PROVENANCE_FLAGS if getattr(self, name))


PROVENANCE_FLAGS = tuple(f.name for f in dataclasses.fields(Provenance))


def count_provenance(views: Iterable[View | Unmeasured], counts: dict[str, int] | None = None) -> dict[str, int]:
    """How many of ``views`` each :class:`Provenance` flag applied to (added into ``counts`` when given).

    >>> count_provenance([Unmeasured(turn=1, at_least=9, chars=30, provenance=Provenance(derived=True))])
    {'derived': 1, 'reasoning_dropped': 0, 'history_reasoning_dropped': 0}
    """
    counts = {name: 0 for name in PROVENANCE_FLAGS} if counts is None else counts
    for view in views:
        for name in view.provenance.flags():
            counts[name] += 1
    return counts


@dataclass(frozen=True, kw_only=True, slots=True)
class View:
    """One N-pass training example: ``tokens[:num_prompt]`` is context, the rest is trained."""

    tokens: np.ndarray  # int64 [n]
    num_prompt: int
    turn: int  # index of the assistant message in Conversation.messages
    source: str = "<memory>"
    boundary_merge: bool = False  # tokenizing prompt+completion as one text gives other tokens
    provenance: Provenance = Provenance()  # how its completion was found (the template's split: no flag)
    first_message: int = 0  # Conversation.first_message: errors number the turn as the record does

    @property
    def at(self) -> str:  # SOURCE, message N: as Conversation.at names this turn
        return message_at(self.source, self.turn + self.first_message)

    @property
    def num_completion(self) -> int:
        return len(self.tokens) - self.num_prompt

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class Unmeasured:
    """A view known to be over ``max_tokens`` without tokenizing it: it has at least ``at_least`` tokens
    (:func:`onepass.render.token_floor.token_floor` of its ``chars`` characters). It carries the provenance of
    the :class:`View` it stands for, so the counts are those of the tokenized view; the schedule skips it
    as it skips a view over the budget, with the floor in place of the length it never learnt.

    ``rendered=False``: the template was not even called for it (:mod:`onepass.render.preskip`): the floor
    is of the messages' text it must hold (``chars`` characters), and its provenance is unknown (no flag)."""

    turn: int
    at_least: int
    chars: int
    source: str = "<memory>"
    provenance: Provenance = Provenance()
    first_message: int = 0
    rendered: bool = True

    @property
    def at(self) -> str:
        return message_at(self.source, self.turn + self.first_message)


def over_budget(view: View | Unmeasured, max_tokens: int) -> str:
    """The skip message of a view longer than ``max_tokens`` on its own."""
    if isinstance(view, Unmeasured) and not view.rendered:
        return (f"{view.at}: view of at least {view.at_least} tokens (not rendered: the {view.chars} characters of "
                f"its messages it must hold) is longer than max_tokens={max_tokens}")
    if isinstance(view, Unmeasured):
        return (f"{view.at}: view of at least {view.at_least} tokens ({view.chars} characters, not tokenized) "
                f"is longer than max_tokens={max_tokens}")
    return f"{view.at}: view of {len(view)} tokens is longer than max_tokens={max_tokens}"
