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

A tighter floor for a text only known to be *held* in another one (a message's content inside a view the
template has not rendered: :mod:`onepass.render.preskip`) counts **cuts**: byte pairs ``(a, b)`` that lie
inside no vocabulary entry. The tokens of any text are vocabulary entries covering it end to end, so where
``a`` is followed by ``b`` one token ends, whatever surrounds the pair; cuts at distinct places end distinct
tokens, and the text's last token ends after all of them. Qwen3's vocabulary has no entry holding a letter
followed by a space or two digits, so ``"what is 12 plus 13?"`` has 8 cuts, so at least 9 tokens (it has 10),
where the byte floor (``L`` = 256) says 1. Cuts are counted only for a byte-level BPE (its
entries are the bytes they cover; checked on the tokenizer's own pre-tokenizer) with no ``unk`` fused over
several characters and no added token that strips the whitespace beside it, under no normalizer or a
Unicode normal form: then only a pair of ASCII characters followed by an ASCII character is counted (no
normal form changes an ASCII character, joins two, or puts anything between them; the third keeps the
second from composing with a combining mark after it).

:func:`token_floor` and :func:`token_cuts` are checked against real token counts in tests/render/test_token_floor.py.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onepass.render.encode import added_ends
from onepass.render.tokenizer import vocab_size

_GROWING_NORMALIZERS = {"Prepend"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}
_longest: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[int, bool] | None]] = weakref.WeakKeyDictionary()
_pairs: weakref.WeakKeyDictionary[Any, tuple[Any, np.ndarray | None]] = weakref.WeakKeyDictionary()


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
    return _per_tokenizer(_longest, _measure, tokenizer)


def _per_tokenizer(store: weakref.WeakKeyDictionary, compute: Callable[[Any], Any], tokenizer: Any) -> Any:
    """``compute(tokenizer)``, kept in ``store`` while the tokenizer lives and its vocabulary size stays the
    same; None for a tokenizer that is not a HF fast one (no bound)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # not a HF fast tokenizer: no bound
        return None
    key = vocab_size(tokenizer)
    try:
        cached = store.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed each time
        return compute(tokenizer)
    if cached is None or cached[0] != key:
        cached = (key, compute(tokenizer))
        store[tokenizer] = cached
    return cached[1]


def token_floor(tokenizer: Any, text: str) -> int:
    """At least this many tokens encode ``text`` (no special tokens added); 0 when not provable."""
    measured = longest_token(tokenizer)
    if measured is None or not text:
        return 0
    longest, ascii_only = measured
    size = len(text.encode("ascii", "ignore")) if ascii_only else len(text.encode())
    return -(-size // longest)


def floor_bytes(tokenizer: Any, text: str) -> int:
    """The bytes of ``text`` :func:`token_floor` divides by ``L`` (0 when no bound is provable): additive over
    texts, so the floor of a text holding several is ``ceil(sum / L)`` (:func:`held_floor`)."""
    measured = longest_token(tokenizer)
    if measured is None or not text:
        return 0
    return len(text.encode("ascii", "ignore")) if measured[1] else len(text.encode())


def _byte_level_alphabet() -> dict[str, int]:
    """The ByteLevel pre-tokenizer's character for each byte (GPT-2's table), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


_PROBE = " " + "".join(map(chr, [*range(1, 0xC0), *range(0xC0, 0x800, 0x40), 0x800, *range(0x1000, 0x10000, 0x1000),
                                   0x10000, 0x40000, 0x80000, 0xC0000, 0x100000]))
"""Every byte valid UTF-8 can hold: ASCII, each lead byte and each continuation byte (the leading space: a
pre-tokenizer that adds one adds none here)."""


def _maps_bytes_as(backend: Any, alphabet: dict[str, int]) -> bool:
    """Does the tokenizer's own pre-tokenizer write each byte of :data:`_PROBE` as ``alphabet``'s character?"""
    try:
        mapped = "".join(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(_PROBE))
    except Exception:  # noqa: BLE001 - a pre-tokenizer we cannot run proves nothing
        return False
    data = _PROBE.encode()
    return len(mapped) == len(data) and all(alphabet.get(c) == b for c, b in zip(mapped, data))


def _pair_table(tokenizer: Any) -> np.ndarray | None:
    """``bool[65536]``: True at ``a * 256 + b`` where the byte pair ``(a, b)`` lies inside no vocabulary
    entry (a cut), for a tokenizer the cuts are provable for (module docstring); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    measured = longest_token(tokenizer)
    if backend is None or measured is None or getattr(backend.model, "fuse_unk", True):
        return None
    normalizer = _steps(_state(backend.normalizer), "normalizers")
    if any(step.get("type") not in _UNICODE_FORMS | _GROWING_NORMALIZERS for step in normalizer):
        return None
    if not _pre_tokenizer_ok(_state(backend.pre_tokenizer))[1]:  # not byte-level: entries are not their bytes
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):  # such a token covers the whitespace beside it too
        return None
    alphabet = _byte_level_alphabet()
    if not _maps_bytes_as(backend, alphabet):
        return None
    # An entry read wrongly (characters outside the alphabet, dropped) or twice only adds pairs: fewer cuts, safe.
    to_bytes = {ord(c): b for c, b in alphabet.items()}
    vocab = list(backend.get_vocab(with_added_tokens=False))
    entries = [e.translate(to_bytes).encode("latin-1", "ignore") for e in vocab] + [e.encode() for e in vocab]
    entries += [t.content.encode() for t in added]
    seen = np.zeros(65536, dtype=bool)
    joined = np.frombuffer(b"".join(entries), dtype=np.uint8).astype(np.int64)
    starts = np.cumsum([0] + [len(e) for e in entries])[:-1]
    inside = np.ones(max(len(joined) - 1, 0), dtype=bool)
    inside[(starts[1:] - 1)[starts[1:] > 0]] = False  # the pair across two entries is in neither
    seen[(joined[:-1] * 256 + joined[1:])[inside]] = True
    return ~seen


def pair_table(tokenizer: Any) -> np.ndarray | None:
    """:func:`_pair_table`, computed once per tokenizer (again if its vocabulary grows)."""
    return _per_tokenizer(_pairs, _pair_table, tokenizer)


def token_cuts(tokenizer: Any, text: str) -> int:
    """Places strictly inside ``text`` where a token ends in the tokenization of any text holding ``text``
    verbatim (0 when not provable). Additive over disjoint texts.

    >>> from onepass.render.tokenizer import load_tokenizer
    >>> token_cuts(load_tokenizer("builtin:qwen3"), "what is 12 plus 13?")  # 10 tokens
    8
    """
    table = pair_table(tokenizer)
    if table is None or len(text) < 2:
        return 0
    return int(_cut_mask(tokenizer, table, text.encode()).sum())


def _cut_mask(tokenizer: Any, table: np.ndarray, data: bytes) -> np.ndarray:
    """``bool[len(data) - 1]``: True at ``i`` where a token ends after byte ``i`` (a cut: :func:`token_cuts`)."""
    codes = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    cut = table[codes[:-1] * 256 + codes[1:]]
    if longest_token(tokenizer)[1]:  # type: ignore[index]  # a normal form: ASCII pairs with an ASCII third
        ascii_ = codes < 128
        cut = cut & ascii_[:-1] & ascii_[1:] & np.append(ascii_[2:], False)
    return cut


def text_floor(tokenizer: Any, text: str) -> int:
    """At least this many tokens encode ``text`` on its own (no special tokens added), nearly as many as it has:
    a token ends at every cut (:func:`token_cuts`), on both sides of every added token the tokenizer cuts the
    text at (``<|im_start|>``: :func:`onepass.render.encode.added_ends`), and at the end. A rendered prompt is
    mostly role headers between added tokens and short words, where the byte floor says little.

    >>> from onepass.render.tokenizer import load_tokenizer
    >>> tok = load_tokenizer("builtin:qwen3")
    >>> text = "<|im_start|>user\\nwhat is 12 plus 13?<|im_end|>\\n"  # 15 tokens
    >>> token_floor(tok, text), token_cuts(tok, text) + 1, text_floor(tok, text)
    (1, 13, 15)
    """
    table = pair_table(tokenizer)
    if table is None or len(text) < 2:
        return token_floor(tokenizer, text)
    data = text.encode()
    ends = np.zeros(len(data) + 1, dtype=bool)  # ends[p]: a token ends before byte p
    ends[1:-1] = _cut_mask(tokenizer, table, data)
    ends[added_ends(tokenizer, data)] = True
    ends[0], ends[-1] = False, True
    return max(int(ends.sum()), token_floor(tokenizer, text))


def held_floor(tokenizer: Any, cuts: int, size: int) -> int:
    """At least this many tokens encode a text holding, as disjoint substrings, texts with ``cuts``
    :func:`token_cuts` and ``size`` :func:`floor_bytes` in all (0 when they are empty or prove nothing)."""
    measured = longest_token(tokenizer)
    if measured is None:
        return 0
    by_bytes = -(-size // measured[0])
    return max(cuts + 1 if cuts else 0, by_bytes)


def parts_floor(tokenizer: Any, parts: Sequence[str]) -> int:
    """:func:`held_floor` of ``parts`` (the reference the pre-skip's prefix sums are compared with)."""
    return held_floor(tokenizer, sum(token_cuts(tokenizer, p) for p in parts),
                      sum(floor_bytes(tokenizer, p) for p in parts))
