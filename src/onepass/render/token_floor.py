"""A lower bound on a text's token count, without tokenizing it.

Why this module exists: a view over ``max_tokens`` is skipped, but finding its length by tokenizing
costs time and memory in proportion to the text (issue 24: one 50 MB record took 6.9 GB of RSS and
35 s just to be skipped). No token stands for more than ``L`` bytes of the text the tokenizer's model
sees, so a text of ``B`` such bytes has at least ``ceil(B / L)`` tokens; when that floor is already
over the budget, the view cannot fit and is skipped without being tokenized
(:func:`onepass.render.views.render_conversation`).

The floor must never be above the true count (a view that fits must never be skipped), so it is
given only where that is provable from the tokenizer's own description, and is 0 (no bound) elsewhere:

- the model is BPE over bytes: a ``ByteLevel`` pre-tokenizer, or ``byte_fallback``, so every byte of
  the text ends up inside some token (no unknown token swallowing a run of characters);
- no pre-tokenizer step removes text (``Split`` with ``Removed``, ``Whitespace``, ... are refused);
- the normalizer only grows the text (``Prepend``, ``Replace`` by something no shorter), or is a Unicode
  normal form (``NFC``, ``NFKC``, ...), under which only the ASCII characters are counted (each one stays
  at least one byte of its own: ASCII characters are starters that no normal form removes or joins);
- ``L`` is the longest vocabulary entry, added tokens included, in UTF-8 bytes: a byte-level entry
  stands for one byte per character (fewer than its UTF-8 length), a SentencePiece ``▁`` for one space,
  a byte-fallback ``<0x0A>`` for one byte, so the UTF-8 length is never below what the entry covers.

:func:`token_floor` is checked against real token counts in tests/test_token_floor.py.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

_GROWING_NORMALIZERS = {"Prepend"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}
_longest: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[int, bool] | None]] = weakref.WeakKeyDictionary()


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _steps(state: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [s for child in state.get(key, []) for s in _steps(child, key)]
    return [state]


def _normalizer_ok(state: dict[str, Any] | None) -> tuple[bool, bool]:
    """(the bound holds under this normalizer, count only ASCII characters)."""
    ascii_only = False
    for step in _steps(state, "normalizers"):
        kind = step.get("type")
        if kind in _UNICODE_FORMS:
            ascii_only = True
        elif kind == "Replace":
            pattern, content = step.get("pattern", {}), step.get("content", "")
            if "String" not in pattern or len(content.encode()) < len(pattern["String"].encode()):
                return False, False
        elif kind not in _GROWING_NORMALIZERS:
            return False, False
    return True, ascii_only


def _pre_tokenizer_ok(state: dict[str, Any] | None) -> tuple[bool, bool]:
    """(no step removes text, a ByteLevel step is there)."""
    steps = _steps(state, "pretokenizers")
    keeps = all(s.get("type") in _KEEPING_PRE_TOKENIZERS and s.get("behavior") != "Removed" for s in steps)
    return keeps, any(s.get("type") == "ByteLevel" for s in steps)


def _measure(tokenizer: Any) -> tuple[int, bool] | None:
    """(L, count only ASCII) for a tokenizer the bound is provable for, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    normalizer_ok, ascii_only = _normalizer_ok(_state(backend.normalizer))
    keeps, byte_level = _pre_tokenizer_ok(_state(backend.pre_tokenizer))
    if not (normalizer_ok and keeps and (byte_level or backend.model.byte_fallback)):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(len(s.encode()) for s in vocab), ascii_only


def longest_token(tokenizer: Any) -> tuple[int, bool] | None:
    """``(L, ascii_only)`` of :func:`_measure`, computed once per tokenizer (again if its vocabulary grows)."""
    try:
        key = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    except AttributeError:  # not a HF fast tokenizer: no bound
        return None
    try:
        cached = _longest.get(tokenizer)
    except TypeError:
        return _measure(tokenizer)
    if cached is None or cached[0] != key:
        cached = (key, _measure(tokenizer))
        _longest[tokenizer] = cached
    return cached[1]


def token_floor(tokenizer: Any, text: str) -> int:
    """At least this many tokens encode ``text`` (no special tokens added); 0 when not provable."""
    measured = longest_token(tokenizer)
    if measured is None or not text:
        return 0
    longest, ascii_only = measured
    size = len(text.encode("ascii", "ignore")) if ascii_only else len(text.encode())
    return -(-size // longest)
