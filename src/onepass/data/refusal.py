"""Refusals are not reasoning: the check ``onepass data augment`` runs on every reply.

Why this module exists: an LLM asked for the hidden reasoning of a reply sometimes
declines ("I'm sorry, but I can't help with that."), and it does so in the JSON it
was asked for, so the reply parses: ``{"reasoning": "I'm sorry, ..."}``. Trained
on, such text teaches the model to refuse. So every reply's reasoning (and every
cached one) is matched against refusal patterns; a match is a failed attempt,
retried and then reported per turn like any other failure, and counted.

Patterns are case-insensitive regular expressions searched in the reasoning
(``re.search``); ``^`` anchors to its start. The defaults are phrasings a
refusal opens with or contains, chosen so that ordinary reasoning ("I can't
divide by zero, so ...") does not match::

    >>> check = RefusalCheck.default()
    >>> check.match("I'm sorry, but I can't help with that.") is not None
    True
    >>> check.match("I can't divide by zero, so the answer is undefined.") is None
    True

``--refusal-pattern REGEX`` adds a pattern, ``--refusal-patterns FILE`` replaces the
defaults (one regex a line; blank lines and lines starting with ``#`` are ignored),
``--no-refusal-check`` turns the check off.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from onepass.errors import DataNotFound, UsageError

_CANT = r"(?:can(?:no|'|’)?t|cannot|won(?:'|’)?t|will not|am unable to|'m unable to|am not able to|'m not able to)"
_NOT = r"(?:can(?:no|'|’)?t|cannot|won(?:'|’)?t|will not|unable|not able)"
_DO = r"(?:help|assist|comply|do (?:that|this)|fulfil+|provide (?:that|this|the requested|it))"

DEFAULT_PATTERNS: tuple[str, ...] = (
    rf"^\W*(?:I'm|I am|I’m)\s+(?:sorry|afraid)\b.{{0,60}}?\b{_NOT}\b",  # "I'm sorry, but I can't ..."
    rf"^\W*(?:sorry|unfortunately|apologies)\b.{{0,40}}?\bI\s+{_CANT}",
    rf"^\W*I\s+{_CANT}\s+(?:\w+\s+)?{_DO}\b",  # "I can't help with that" opening the text
    rf"\bI\s+{_CANT}\s+(?:help|assist|comply) with (?:this|that|your) request\b",
    r"\bI (?:must|have to|need to) (?:decline|refuse)\b",
    r"\bas an AI(?: language model| assistant)?\b",
    r"\b(?:violates?|against) (?:my|our|the|openai'?s?) (?:\w+ )?(?:guidelines|polic(?:y|ies)|terms)\b",
    r"\bI(?:'m| am) not (?:comfortable|allowed|permitted) (?:to )?(?:help|assist|provide|writ|generat)",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RefusalCheck:
    """Compiled refusal patterns; :meth:`match` returns the first that matches, or ``None``."""

    patterns: tuple[str, ...]
    compiled: tuple[re.Pattern[str], ...]

    @classmethod
    def of(cls, patterns: Iterable[str]) -> RefusalCheck:
        """Compile ``patterns``; a bad one is a :class:`UsageError` naming it."""
        patterns = tuple(patterns)
        compiled = []
        for p in patterns:
            try:
                compiled.append(re.compile(p, re.IGNORECASE))
            except re.error as e:
                raise UsageError(f"refusal pattern {p!r} is not a valid regular expression: {e}") from None
        return cls(patterns=patterns, compiled=tuple(compiled))

    @classmethod
    def default(cls) -> RefusalCheck:
        return cls.of(DEFAULT_PATTERNS)

    @classmethod
    def none(cls) -> RefusalCheck:
        """No check: every reply is accepted (``--no-refusal-check``)."""
        return cls.of(())

    def match(self, text: str) -> str | None:
        for pattern, rx in zip(self.patterns, self.compiled):
            if rx.search(text):
                return pattern
        return None


def read_patterns(path: str | Path) -> list[str]:
    """The patterns of a file: one regex a line, blank lines and ``#`` comments skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataNotFound(f"--refusal-patterns file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--refusal-patterns {path}: cannot read it ({e})") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def refusal_check(*, extra: Sequence[str] = (), patterns_file: str | Path | None = None,
                  off: bool = False) -> RefusalCheck:
    """The check the CLI flags ask for: the defaults (or a file's patterns) plus ``extra``, or none."""
    if off:
        if extra or patterns_file:
            raise UsageError("--no-refusal-check cannot go with --refusal-pattern or --refusal-patterns")
        return RefusalCheck.none()
    base = read_patterns(patterns_file) if patterns_file else list(DEFAULT_PATTERNS)
    return RefusalCheck.of([*base, *extra])
