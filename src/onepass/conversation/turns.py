"""Which assistant turns are trained: every one, the last one, or those the record marks.

Why this module exists: a conversation's assistant turns are each a target by default, yet users
ask to train only some (OpenPipe ART's ``assistant_turns="last"``, SpecForge's
``--train-only-last-turn``, axolotl's per-message training flag; LLaMA-Factory and ms-swift
maintainers advise training the last turn only). The choice is one setting
(``DataConfig.train_turns``, ``--train-turns``) read here, once, by the renderer: a turn not chosen
gets no view and stays in the context of later turns, exactly as a record's ``"weight": 0`` does,
and both are counted (``turns_not_trained``, ``turns_not_selected`` in ``stats.json``). A turn is
always trained in its own view, so any choice is one-pass's loss = the N-pass loss over the chosen
turns.

- ``all`` (default): every assistant turn but those a record marks ``"weight": 0``;
- ``last``: the last assistant message of each conversation (the final answer of an agent
  trajectory; none when the record marks it ``"weight": 0``); earlier ones are context;
- ``weight``: only assistant messages the record marks ``"weight": 1`` (OpenAI's per-message
  field): a data set that flags the turns to train, every unmarked turn context.

Worked example (user u, assistant a; the record marks a3 with ``"weight": 1``)::

    messages   u0 a1 u2 a3 u4 a5
    all        a1 a3 a5
    last       a5
    weight     a3

No torch here: this is pure data.
"""

from __future__ import annotations

from onepass.conversation.parse import Conversation

TRAIN_TURNS = ("all", "last", "weight")
"""``--train-turns``: which assistant turns get a view (see the module doc)."""

TRAIN_TURNS_HELP = ("which assistant turns are trained: all (default; a message with \"weight\": 0 is context), "
                    "last (the last assistant message of each conversation), weight (only messages marked "
                    "\"weight\": 1); the others stay in the context of later turns (counted)")
"""The ``--train-turns`` help of every subcommand and config that takes it."""


def selected_turns(conv: Conversation, train_turns: str = "all") -> list[int]:
    """The indices (into ``conv.messages``) of the assistant turns ``train_turns`` trains, in order.

    >>> from onepass.conversation.parse import parse_record
    >>> conv = parse_record({"messages": [
    ...     {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
    ...     {"role": "user", "content": "q"}, {"role": "assistant", "content": "b", "weight": 1},
    ...     {"role": "user", "content": "q"}, {"role": "assistant", "content": "c"}]})
    >>> selected_turns(conv, "all"), selected_turns(conv, "last"), selected_turns(conv, "weight")
    ([1, 3, 5], [5], [3])
    """
    assistant = [k for k, m in enumerate(conv.messages) if m.role == "assistant"]
    if train_turns == "all":
        return [k for k in assistant if conv.messages[k].train]
    if train_turns == "last":
        return [k for k in assistant[-1:] if conv.messages[k].train]
    if train_turns == "weight":
        return [k for k in assistant if conv.messages[k].marked]
    raise ValueError(f"unknown train_turns {train_turns!r}; use one of {', '.join(TRAIN_TURNS)}")


def not_selected(conv: Conversation, train_turns: str = "all") -> int:
    """Assistant turns the record lets train (no ``"weight": 0``) that ``train_turns`` leaves as context."""
    trainable = sum(m.role == "assistant" and m.train for m in conv.messages)
    return trainable - len(selected_turns(conv, train_turns))
