"""Final answers: find the one a reply commits to, and compare two of them.

Why this module exists: a multi-turn math evaluation scores each turn by its
final answer, not by its wording. The bundled MathChat data ends its answers
with "The answer is 18." (the GSM8K ``#### N`` line, converted), some with
``\\boxed{20}``; models trained on it answer the same way. So the default
extraction, in this order (the first rule that finds something wins):

1. ``\\boxed{...}`` (or ``\\fbox{...}``): the last one, braces nested to any depth;
2. "the answer is X" (any case, also "final answer is", "correct answer is",
   an optional ":"): the last one, X up to the end of its line.

A user regex (``--answer-regex``) replaces both: its last match, group 1 if it
has groups, else the whole match. No rule finding anything means "no answer",
which is scored as wrong and counted on its own in the report.

Comparison (:func:`normalize_answer`) is deliberately minimal and exact:

- LaTeX wrappers go: ``\\( \\) \\[ \\] $``, ``\\text{..}``, ``\\mathrm{..}``,
  ``\\boxed{..}``, ``\\!``, ``\\,``, ``\\%`` and ``%``, ``\\$``; a trailing ``.``.
- A **leading number wins**: "1,000 apples" -> 1000, "$49.50" -> 99/2,
  "3.0" -> 3, "\\frac{1}{2}" / "\\dfrac{1}{2}" / "1/2" / "0.5" -> 1/2,
  "-4" -> -4. Numbers compare as exact fractions (no float tolerance), so
  "0.333" is not "1/3".
- Anything else compares as lower-case text with single spaces.

    >>> extract_answer("So... The answer is $1,430.")
    '$1,430'
    >>> extract_answer(r"We get \\boxed{\\frac{1}{2}} in the end")
    '\\\\frac{1}{2}'
    >>> normalize_answer("$1,430"), normalize_answer(r"\\frac{1}{2}"), normalize_answer("3.0 hours")
    ('1430', '1/2', '3')
    >>> answers_match("45.50", "45.5 dollars")
    True

No torch here.
"""

from __future__ import annotations

import re
from fractions import Fraction

from onepass.errors import UsageError

_ANSWER_IS = re.compile(r"\banswer\s+is\s*:?[ \t]*", re.IGNORECASE)  # "final/correct answer is" included
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|boxed|fbox)\s*\{([^{}]*)\}")
_DROP = re.compile(r"\\[()\[\]]|\\[!,;]|\\?\$|\\?%|\\left|\\right")
_FRAC = re.compile(r"^\\d?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}")
_NUMBER = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|^[-+]?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces balanced; None if there is none
    (or it is never closed)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
            i += 1
    return None


def compile_answer_regex(pattern: str | None) -> re.Pattern[str] | None:
    """``--answer-regex``, compiled; a bad one is one line naming it."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UsageError(f"--answer-regex {pattern!r} is not a valid regular expression: {e}") from None


def extract_answer(text: str, regex: re.Pattern[str] | str | None = None) -> str | None:
    """The final answer ``text`` commits to (see the module docstring), stripped; None when there is none."""
    if regex is not None:
        pattern = compile_answer_regex(regex) if isinstance(regex, str) else regex
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        found = last.group(1) if pattern.groups else last.group(0)
        return found.strip() if found is not None and found.strip() else None
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    said = list(_ANSWER_IS.finditer(text))
    if said:
        answer = text[said[-1].end():].split("\n", 1)[0].strip().rstrip(".").strip()
        return answer or None
    return None


def _unwrap(text: str) -> str:
    before = None
    while before != text:  # \text{\textbf{5}} -> 5
        before, text = text, _WRAPPERS.sub(r"\1", text)
    return _DROP.sub("", text).strip()


def _number(text: str) -> Fraction | None:
    m = _FRAC.match(text)
    if m:
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den else None
    m = _NUMBER.match(text)
    if not m:
        return None
    token = m.group(0).replace(",", "").replace(" ", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_answer(answer: str) -> str:
    """The canonical form two answers are compared in: an exact number when the answer starts with
    one (``str(Fraction)``: '1430', '1/2', '-4'), else lower-case text with single spaces."""
    text = _unwrap(answer).rstrip(".").strip()
    number = _number(text)
    if number is not None:
        return str(number)
    return " ".join(text.lower().split())


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """True when both are answers and their canonical forms are equal (no answer never matches)."""
    if predicted is None or reference is None:
        return False
    return normalize_answer(predicted) == normalize_answer(reference)
