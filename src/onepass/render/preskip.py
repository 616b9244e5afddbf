"""Views proven over ``max_tokens`` without rendering them: what keeps a long conversation's render linear.

Why this module exists: view k's prompt is the template's own text for ``messages[:k]`` (that is what makes
it exact), so rendering every view of a conversation of n messages hands the template ~n^2/2 messages: 46 s
of CPU for 2,000 messages, and the same with ``--max-tokens 2048``, where 934 of its 1,000 views were
rendered only to be skipped (issue 37). A view is skipped for its length whatever it holds, so a view that
provably cannot fit need not be rendered at all.

What view k must hold, and the floor of its tokens (:mod:`onepass.render.token_floor`)::

    prompt_k      holds  the contents of the user and tool messages of messages[:k], stripped, in order
    completion_k  holds  the turn's own content, stripped (or, with none, its first tool call's name)
    floor_k       =      held_floor(prompt parts) + held_floor(completion part)     (each >= 1, or no skip)

The parts' cuts and bytes are summed once per message, so every view's floor costs O(1) and a conversation
O(its length). Whether the template's texts hold them is not assumed, it is checked on the conversation:

1. the first view whose floor is over ``max_tokens`` is rendered anyway and must hold its parts;
2. the template's prompt for the conversation's last turn (one call: every message up to it) must hold the
   content of every user and tool message, stripped, in order (a template that escapes, truncates, reorders
   or drops one fails here: nothing is skipped unrendered);
3. every view rendered after that must hold its parts too;
4. every turn rendered so far gave a view of the template's own split: none skipped (the template raised,
   could not split it), none derived or with reasoning left out (no :class:`~onepass.layout.view.Provenance` flag).

Then each later view whose floor is over ``max_tokens`` is skipped without a template call
(:class:`~onepass.layout.view.Unmeasured` with ``rendered=False``, no flag: check 4 is why the counts stay those
of a render; the schedule counts it ``over max_tokens`` as it counts a rendered view over the budget). Once
a check fails, every later view is rendered. What the checks leave assumed (docs/faults.md, Round 3): a
template that renders a message's content verbatim in the prompt of the proof turn (check 1) and in that
of the last turn (check 2) renders it so in the prompts between; and a turn skipped unrendered would have
rendered as the conversation's rendered turns did (else the template's skip reason, or a flag, was the
count it lost: the view is skipped either way, no trained byte changes).

The floors are only computed once a rendered view has more bytes than ``max_tokens`` (a token covers a byte
or more of the text the tokenizer sees, so a view is seldom over before; starting late only renders more),
so a conversation whose views all fit costs nothing more.

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.render.token_floor import floor_bytes, held_floor, token_cuts
from onepass.layout.view import Unmeasured

HELD_ROLES = ("user", "tool")  # the messages whose content a prompt must hold


def holds(text: str, parts: Sequence[str]) -> bool:
    """Does ``text`` hold every one of ``parts`` as a substring, in order, none overlapping? (Greedy:
    the leftmost match of each part ends first, so it leaves the most room for the next.)

    >>> holds("<u>a</u><a>b</a><u>a</u>", ["a", "a"]), holds("<u>b</u><u>a</u>", ["a", "b"])
    (True, False)
    """
    at = 0
    for part in parts:
        found = text.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


class Preskip:
    """One conversation's pre-skip: :meth:`skip` before a turn is rendered, :meth:`saw` after.

    ``render_prompt(k)`` is the template's prompt for turn ``k`` (None where the template raises), called
    once, for ``last_turn``, the conversation's last turn with a view: check 2 of the module docstring."""

    def __init__(self, conv: Conversation, tokenizer: Any, max_tokens: int, *, last_turn: int,
                 render_prompt: Callable[[int], str | None]):
        self.conv, self.tokenizer, self.max_tokens = conv, tokenizer, max_tokens
        self.last_turn, self._render_prompt = last_turn, render_prompt
        self.state = "waiting"  # -> "measuring" (a view over max_tokens bytes) -> "proven" | "refused"
        self._cuts: list[int] = []  # per message prefix: the held parts' token cuts, floor bytes, characters
        self._bytes: list[int] = []
        self._chars: list[int] = []

    def prompt_parts(self, k: int) -> list[str]:
        """What view ``k``'s prompt must hold: the stripped contents of ``messages[:k]`` in :data:`HELD_ROLES`."""
        return [p for m in self.conv.messages[:k] if m.role in HELD_ROLES and (p := m.content.strip())]

    def completion_part(self, k: int) -> str:
        """What view ``k``'s completion must hold: its content, stripped, else its first tool call's name."""
        message = self.conv.messages[k]
        return message.content.strip() or (message.tool_calls[0].name if message.tool_calls else "")

    def _measure(self) -> None:
        """Each message's cuts and floor bytes (its held part: nothing for other roles), summed as prefixes."""
        tok = self.tokenizer
        parts = [m.content.strip() if m.role in HELD_ROLES else "" for m in self.conv.messages]
        self._cuts = [0, *accumulate(token_cuts(tok, p) for p in parts)]
        self._bytes = [0, *accumulate(floor_bytes(tok, p) for p in parts)]
        self._chars = [0, *accumulate(map(len, parts))]

    def floors(self, k: int) -> tuple[int, int]:
        """(prompt, completion) floors of view ``k``'s tokens from what each must hold: O(1) per view."""
        tok, part = self.tokenizer, self.completion_part(k)
        prompt = held_floor(tok, self._cuts[k], self._bytes[k])
        return prompt, held_floor(tok, token_cuts(tok, part), floor_bytes(tok, part))

    def _over(self, k: int) -> int | None:
        """View ``k``'s floor when it is over ``max_tokens`` (each part at least one token), else None."""
        prompt, completion = self.floors(k)
        return prompt + completion if min(prompt, completion) >= 1 and prompt + completion > self.max_tokens else None

    def skip(self, k: int) -> Unmeasured | None:
        """View ``k`` as an unrendered :class:`Unmeasured` when it is proven over ``max_tokens``; else None."""
        if self.state != "proven" or (floor := self._over(k)) is None:
            return None
        chars = self._chars[k] + len(self.completion_part(k))
        return Unmeasured(turn=k, at_least=floor, chars=chars, source=self.conv.source,
                          first_message=self.conv.first_message, rendered=False)

    def failed(self, k: int) -> None:
        """Turn ``k`` gave no view, or one with a flag: skip nothing unrendered from here (check 4)."""
        self.state = "refused"

    def saw(self, k: int, prompt: str, completion: str) -> None:
        """View ``k`` was rendered as ``prompt`` + ``completion``, the template's own split: checks 1 to 3."""
        if self.state == "waiting" and len(prompt.encode()) + len(completion.encode()) > self.max_tokens:
            self.state = "measuring"
            self._measure()
        if self.state not in ("measuring", "proven"):
            return
        own = holds(prompt, self.prompt_parts(k)) and holds(completion, [self.completion_part(k)])
        if not own:
            self.state = "refused"
        elif self.state == "measuring" and self._over(k) is not None:
            last = self._render_prompt(self.last_turn) if k < self.last_turn else None
            self.state = "proven" if last is not None and holds(last, self.prompt_parts(self.last_turn)) else "refused"
