"""Views proven over ``max_tokens`` without rendering them: what keeps a long conversation's render linear.

Why this module exists: view k's prompt is the template's own text for ``messages[:k]`` (that is what makes
it exact), so rendering every view of a conversation of n messages hands the template ~n^2/2 messages: 46 s
of CPU for 2,000 messages, and the same with ``--max-tokens 2048``, where 934 of its 1,000 views were
rendered only to be skipped (issue 37). A view is skipped for its length whatever it holds, so a view that
provably cannot fit need not be rendered at all.

What view k must hold, and two floors of its tokens (:mod:`onepass.render.token_floor`)::

    prompt_k      holds  the contents of the user and tool messages of messages[:k], stripped, in order
                  and    H_u, the last turn's prompt up to the last added token before the content of user
                         message u (the last before k), then the contents of messages[u:k]
    completion_k  holds  the turn's own content, stripped (or, with none, its first tool call's name)
    floor_k       =      max(held_floor(prompt parts), tokens(H_u) + held_floor(parts of messages[u:k]))
                         + held_floor(completion part)                              (each >= 1, or no skip)

The first floor is of the messages alone: the template's own text (role headers, the system prompt, the
tools, earlier answers) is left out, so on short messages it is a third of the real count and views three
times over the budget were rendered to learn they are over (issue 44: 2,000 short messages, 49 s of CPU).
The second, the *history floor*, counts that text exactly: ``tokens(H_u)`` is the token count of a prefix of
the last turn's prompt, rendered and encoded once (it ends at an added token, where the tokenizer always
cuts: :func:`onepass.render.encode.piece_splitter`), so a view is proven over as soon as it is, and the views
rendered are about the ones that fit. The parts' cuts and bytes are summed once per message and H_u's tokens
counted once per user message, so every view's floor costs O(1) and a conversation O(its length).

Whether the template's texts hold them is not assumed, it is checked on the conversation:

1. the first view whose floor is over ``max_tokens`` is rendered anyway and must hold its parts;
2. the template's prompt for the conversation's last turn (one call: every message up to it), rendered once a
   rendered view is surely over the budget (the cuts of its own text: :func:`token_cuts`), must hold the
   content of every user and tool message, stripped, in order (a template that escapes, truncates, reorders
   or drops one fails here: nothing is skipped unrendered);
3. every view rendered after that must hold its parts too, and its prompt must begin with its H_u and hold
   the contents of messages[u:k] after it (a template that renders an earlier message otherwise once the
   conversation is longer, reasoning it drops later, a sliding window: the history floor is off from there,
   the messages' floor stays);
4. every turn rendered so far gave a view of the template's own split: none skipped (the template raised,
   could not split it), none derived or with reasoning left out (no :class:`~onepass.layout.view.Provenance` flag);
5. a turn of the same kind (:meth:`Preskip.kind`: the role before it, whether it calls tools, whether it has
   reasoning) was rendered so: a template that splits a final answer after a tool result otherwise than a call
   (Kimi-K2's is derived) shows it on the first such turn, which is rendered.

Then each later view whose floor is over ``max_tokens`` is skipped without a template call
(:class:`~onepass.layout.view.Unmeasured` with ``rendered=False``, no flag: check 4 is why the counts stay those
of a render; the schedule counts it ``over max_tokens`` as it counts a rendered view over the budget). Once
check 1, 2 or 4 fails, every later view is rendered. What the checks leave assumed (docs/faults.md, Rounds 3
and 4): a template that renders a message's content verbatim, and the history before a user message as the
last turn's prompt does, in the prompts it was checked on (the proof turn's, the last turn's, every one
rendered) renders them so in the prompts between; and a turn skipped unrendered would have rendered as the
conversation's rendered turns did (else the template's skip reason, or a flag, was the count it lost: the view
is skipped either way, no trained byte changes). The history floor is used only for views rendered with the
last turn's tools (a message's own tool list changes the prefix: :meth:`Conversation.tools_at`) and where no
longer added token holds the one H_u ends with (the tokenizer could then cut the prompt elsewhere).

The floors are only computed once a rendered view has more bytes than ``max_tokens`` (a token covers a byte
or more of the text the tokenizer sees, so a view is seldom over before; starting late only renders more),
and the last turn's prompt rendered only once a view is surely over, so a conversation whose views all fit
costs nothing more.

No torch here: this is pure data.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.render.encode import added_pieces, encode_texts, piece_splitter, split_pieces
from onepass.render.token_floor import floor_bytes, held_floor, text_floor, token_cuts
from onepass.layout.view import Unmeasured

HELD_ROLES = ("user", "tool")  # the messages whose content a prompt must hold


def starts(text: str, parts: Sequence[str]) -> list[int] | None:
    """Where ``text`` holds each of ``parts`` as a substring, in order, none overlapping (greedy: the leftmost
    match of each part ends first, so it leaves the most room for the next); None where it does not.

    >>> starts("<u>q</u><a>b</a><u>q</u>", ["q", "q"]), starts("<u>b</u><u>a</u>", ["a", "b"])
    ([3, 19], None)
    """
    at, out = 0, []
    for part in parts:
        found = text.find(part, at)
        if found < 0:
            return None
        out.append(found)
        at = found + len(part)
    return out


def holds(text: str, parts: Sequence[str]) -> bool:
    """Does ``text`` hold every one of ``parts`` as a substring, in order, none overlapping (:func:`starts`)?

    >>> holds("<u>a</u><a>b</a><u>a</u>", ["a", "a"]), holds("<u>b</u><u>a</u>", ["a", "b"])
    (True, False)
    """
    return starts(text, parts) is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class History:
    """The last turn's prompt, read once: for user message ``u``, ``ends[u]`` is where H_u ends in ``text`` (after
    the last added token before u's content) and ``tokens[u]`` the tokens of ``text[:ends[u]]``: exact, since the
    tokenizer cuts at an added token and encodes the pieces between apart (:mod:`onepass.render.encode`)."""

    text: str
    ends: dict[int, int]
    tokens: dict[int, int]

    @classmethod
    def read(cls, tokenizer: Any, conv: Conversation, text: str, last_turn: int) -> History | None:
        """The history of ``text``, the template's prompt for ``last_turn``; None where the tokenizer does not
        cut at added tokens (no exact count of a prefix) or the prompt does not hold the contents in order."""
        pattern = piece_splitter(tokenizer)
        held = [i for i, m in enumerate(conv.messages[:last_turn]) if m.role in HELD_ROLES and m.content.strip()]
        found = starts(text, [conv.messages[i].content.strip() for i in held])
        if pattern is None or found is None:
            return None
        added = added_pieces(tokenizer)
        pieces = split_pieces(pattern, text)
        counts = accumulate(len(ids) for ids in encode_texts(tokenizer, pieces))
        offsets = accumulate(len(p) for p in pieces)
        cuts = [(end, n, p) for p, end, n in zip(pieces, offsets, counts) if p in added]  # after each added token
        cut_ends = [end for end, _, _ in cuts]
        nested = {p: any(p in other for other in added if other != p) for p in {p for _, _, p in cuts}}
        ends, tokens = {}, {}
        for i, at in zip(held, found):
            j = bisect.bisect_right(cut_ends, at) - 1  # the last added token that ends by u's content
            if conv.messages[i].role == "user" and j >= 0 and not nested[cuts[j][2]]:
                ends[i], tokens[i] = cuts[j][0], cuts[j][1]
        return cls(text=text, ends=ends, tokens=tokens)


class Preskip:
    """One conversation's pre-skip: :meth:`skip` before a turn is rendered, :meth:`saw` after.

    ``render_prompt(k)`` is the template's prompt for turn ``k`` (None where the template raises), called
    once, for ``last_turn``, the conversation's last turn with a view: check 2 of the module docstring."""

    def __init__(self, conv: Conversation, tokenizer: Any, max_tokens: int, *, last_turn: int,
                 render_prompt: Callable[[int], str | None]):
        self.conv, self.tokenizer, self.max_tokens = conv, tokenizer, max_tokens
        self.last_turn, self._render_prompt = last_turn, render_prompt
        self.state = "waiting"  # -> "measuring" (a view over max_tokens bytes) -> "proven" | "refused"
        self.history: History | None = None  # the last turn's prompt read (check 2); None: the messages' floor only
        self._read = False  # the last turn's prompt was rendered and passed check 2
        self._cuts: list[int] = []  # per message prefix: the held parts' token cuts, floor bytes, characters
        self._bytes: list[int] = []
        self._chars: list[int] = []
        self._last_user: list[int] = []  # per view k: the last user message with content before it (-1: none)
        self._kinds: set[tuple[str, bool, bool]] = set()  # kinds of the turns rendered as the template's split (check 5)

    def prompt_parts(self, k: int) -> list[str]:
        """What view ``k``'s prompt must hold: the stripped contents of ``messages[:k]`` in :data:`HELD_ROLES`."""
        return self._parts(0, k)

    def _parts(self, start: int, k: int) -> list[str]:
        return [p for m in self.conv.messages[start:k] if m.role in HELD_ROLES and (p := m.content.strip())]

    def kind(self, k: int) -> tuple[str, bool, bool]:
        """Turn ``k``'s kind for check 5: (the role of the message before it, it calls tools, it has reasoning)."""
        message = self.conv.messages[k]
        return (self.conv.messages[k - 1].role if k else "", bool(message.tool_calls), bool(message.reasoning))

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
        self._last_user = [-1, *accumulate((i if m.role == "user" and p else -1 for i, (m, p) in
                                            enumerate(zip(self.conv.messages, parts))), max)]

    def history_user(self, k: int) -> int | None:
        """The user message whose H_u bounds view ``k``'s prompt (module docstring), where the history floor applies:
        the last turn's prompt was read, ``k`` sees its tools, and a user message with content comes before it."""
        if self.history is None or self.conv.tools_at(k) is not self.conv.tools_at(self.last_turn):
            return None
        u = self._last_user[k]
        return u if u in self.history.ends else None

    def floors(self, k: int) -> tuple[int, int]:
        """(prompt, completion) floors of view ``k``'s tokens from what each must hold: O(1) per view."""
        tok, part = self.tokenizer, self.completion_part(k)
        prompt = held_floor(tok, self._cuts[k], self._bytes[k])
        if (u := self.history_user(k)) is not None:
            after = held_floor(tok, self._cuts[k] - self._cuts[u], self._bytes[k] - self._bytes[u])
            prompt = max(prompt, self.history.tokens[u] + after)  # type: ignore[union-attr]
        return prompt, held_floor(tok, token_cuts(tok, part), floor_bytes(tok, part))

    def _over(self, k: int) -> int | None:
        """View ``k``'s floor when it is over ``max_tokens`` (each part at least one token), else None."""
        prompt, completion = self.floors(k)
        return prompt + completion if min(prompt, completion) >= 1 and prompt + completion > self.max_tokens else None

    def skip(self, k: int) -> Unmeasured | None:
        """View ``k`` as an unrendered :class:`Unmeasured` when it is proven over ``max_tokens``; else None."""
        if self.state != "proven" or self.kind(k) not in self._kinds or (floor := self._over(k)) is None:
            return None
        u = self.history_user(k)
        held = self._chars[k] if u is None else self.history.ends[u] + self._chars[k] - self._chars[u]  # type: ignore
        return Unmeasured(turn=k, at_least=floor, chars=held + len(self.completion_part(k)), source=self.conv.source,
                          first_message=self.conv.first_message, rendered=False)

    def failed(self, k: int) -> None:
        """Turn ``k`` gave no view, or one with a flag: skip nothing unrendered from here (check 4)."""
        self.state = "refused"

    def _surely_over(self, prompt: str, completion: str) -> bool:
        """Is the view of these texts over ``max_tokens`` by the floor of its own text (each part encoded apart:
        :func:`text_floor`, about its real count)? Never below the floor of the parts it holds, so the proof view
        (check 1) always is."""
        return text_floor(self.tokenizer, prompt) + text_floor(self.tokenizer, completion) > self.max_tokens

    def _read_last(self) -> None:
        """Check 2: the last turn's prompt, rendered once, holds every held part in order; its history read."""
        self._read = True
        last = self._render_prompt(self.last_turn)
        if last is None or not holds(last, self.prompt_parts(self.last_turn)):
            self.state = "refused"
            return
        self.history = History.read(self.tokenizer, self.conv, last, self.last_turn)

    def _holds_history(self, k: int, u: int, prompt: str) -> bool:
        """Check 3's history part: view ``k``'s prompt begins with H_u and holds the contents of ``messages[u:k]``
        after it."""
        end = self.history.ends[u]  # type: ignore[union-attr]
        return prompt.startswith(self.history.text[:end]) and holds(prompt[end:], self._parts(u, k))  # type: ignore

    def saw(self, k: int, prompt: str, completion: str) -> None:
        """View ``k`` was rendered as ``prompt`` + ``completion``, the template's own split: checks 1 to 3 (and its
        kind seen, check 5)."""
        self._kinds.add(self.kind(k))
        if self.state == "waiting" and len(prompt.encode()) + len(completion.encode()) > self.max_tokens:
            self.state = "measuring"
            self._measure()
        if self.state not in ("measuring", "proven"):
            return
        if not (holds(prompt, self.prompt_parts(k)) and holds(completion, [self.completion_part(k)])):
            self.state = "refused"
            return
        if not self._read and k < self.last_turn and self._surely_over(prompt, completion):
            self._read_last()
        if (u := self.history_user(k)) is not None and not self._holds_history(k, u, prompt):
            self.history = None  # this template renders the history otherwise: the messages' floor only
        if self.state == "measuring" and self._read and self._over(k) is not None:
            self.state = "proven"
