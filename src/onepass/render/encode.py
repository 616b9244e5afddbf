"""Encoding a conversation's views: each distinct piece of text once.

Why this module exists: view k's prompt holds the whole history before turn k, so encoding every
prompt from scratch encodes the shared history again and again (N-pass text is about twice the
one-pass text) and dominated ``prepare``. A HF fast tokenizer first splits the text at its added
tokens (``<|im_start|>``, ``<think>``, ...) and encodes each piece between them on its own: no BPE
merge ever crosses an added token. So a text's ids are the concatenation of its pieces' ids, and a
piece that repeats across views (a user message, an old assistant turn) is encoded once; a long piece
(a system prompt with tool schemas, which agent data repeats in every conversation) is kept for the
next conversations too (the last :data:`LONG_PIECES` of at least :data:`LONG_PIECE` characters).

    "<|im_start|>user\\nq<|im_end|>\\n<|im_start|>assistant\\n"
    -> "<|im_start|>" | "user\\nq" | "<|im_end|>" | "\\n" | "<|im_start|>" | "assistant\\n"

That holds only when the tokenizer really encodes each piece independently of its neighbours, so
:func:`piece_splitter` checks it once per tokenizer and returns None (use the plain encode) when it
does not: an added token with ``lstrip``/``rstrip``/``single_word`` (it eats or looks at the text
beside it), special tokens encoded as text, or a pre-tokenizer that treats the first piece
differently (SentencePiece ``Metaspace`` with ``prepend_scheme="first"``), caught by a probe that
encodes texts whole and by pieces. :func:`encode_plain` is the reference; tests/render/test_encode.py
compares the two on every vendored template and on the bundled and synthetic data.

No torch here: this is pure data.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from onepass.render.tokenizer import vocab_size

_PROBE_CONTEXTS = (("a", "b"), (" x", " y"), ("\n", "\n\n"), ("é ", "中文"), ("", " "), ("1", ""))
_splitters: weakref.WeakKeyDictionary[Any, tuple[Any, re.Pattern[str] | None]] = weakref.WeakKeyDictionary()


def encode_plain(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text encoded whole by the tokenizer's own call (no special tokens added): the reference."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def _fingerprint(tokenizer: Any) -> Any:
    backend = tokenizer.backend_tokenizer
    return (vocab_size(tokenizer), getattr(backend, "encode_special_tokens", None),
            getattr(tokenizer, "split_special_tokens", None))


def _probe(tokenizer: Any) -> re.Pattern[str] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    added = backend.get_added_tokens_decoder()  # id -> tokenizers.AddedToken
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None
    raw = _raw_added(added)
    if not raw:
        return None
    # leftmost-longest, as the tokenizer's Aho-Corasick matcher: longer alternatives first
    pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(raw, key=len, reverse=True)) + ")")
    tokens = sorted(raw)
    texts = [before + s + after for s in tokens for before, after in _PROBE_CONTEXTS]
    texts += [tokens[i - 1] + "z" + tokens[i] + tokens[i - 1] for i in range(len(tokens))]
    whole = encode_plain(tokenizer, texts)
    alone = dict(zip(tokens, encode_plain(tokenizer, tokens)))
    if any(alone[s] != [raw[s]] for s in tokens):  # the tokenizer does not split at it
        return None
    if _encode_by_pieces(tokenizer, pattern, texts) != whole:
        return None
    return pattern


def _raw_added(added: dict[int, Any]) -> dict[str, int]:
    """The added tokens matched on the raw text (``normalized=False``), content -> id: they split the text first;
    normalized ones are matched later inside each piece, so the tokenizer handles them when it encodes the piece."""
    return {t.content: i for i, t in added.items() if not t.normalized and t.content}


def added_pieces(tokenizer: Any) -> frozenset[str]:
    """The texts :func:`piece_splitter` cuts at (each is one token), or nothing where it cuts at none."""
    if piece_splitter(tokenizer) is None:
        return frozenset()
    return frozenset(_raw_added(tokenizer.backend_tokenizer.get_added_tokens_decoder()))


def piece_splitter(tokenizer: Any) -> re.Pattern[str] | None:
    """The pattern of the added tokens ``tokenizer`` splits text at, when encoding by pieces gives
    exactly its own ids (checked once per tokenizer, again if its added tokens change); else None."""
    try:
        key = _fingerprint(tokenizer)
    except AttributeError:  # not a HF fast tokenizer
        return None
    try:
        cached = _splitters.get(tokenizer)
    except TypeError:  # not weak-referenceable or hashable: probe every time
        return _probe(tokenizer)
    if cached is None or cached[0] != key:
        cached = (key, _probe(tokenizer))
        _splitters[tokenizer] = cached
    return cached[1]


def added_ends(tokenizer: Any, data: bytes) -> list[int]:
    """The byte offsets in UTF-8 ``data`` where a piece ends, before and after every added token
    :func:`piece_splitter` cuts at (the tokenizer ends a token there); nothing where it cuts at none."""
    pattern = piece_splitter(tokenizer)
    if pattern is None:
        return []
    return [at for m in _bytes_pattern(pattern).finditer(data) for at in m.span()]


_bytes_patterns: dict[re.Pattern[str], re.Pattern[bytes]] = {}


def _bytes_pattern(pattern: re.Pattern[str]) -> re.Pattern[bytes]:
    """``pattern`` (literal alternatives, :func:`_probe`) over UTF-8 bytes, compiled once."""
    if pattern not in _bytes_patterns:
        _bytes_patterns[pattern] = re.compile(pattern.pattern.encode())
    return _bytes_patterns[pattern]


def split_pieces(pattern: re.Pattern[str], text: str) -> list[str]:
    """``text`` cut before and after every added-token match, empty pieces dropped."""
    return [p for p in pattern.split(text) if p]


LONG_PIECE = 2048  # characters: a piece this long (a system prompt, tool schemas) is kept across calls
LONG_PIECES = 64  # ... the last this many of them, per tokenizer
_long: weakref.WeakKeyDictionary[Any, tuple[Any, OrderedDict[str, list[int]]]] = weakref.WeakKeyDictionary()


def _long_pieces(tokenizer: Any) -> OrderedDict[str, list[int]] | None:
    """The ids of the long pieces this tokenizer encoded lately (least recently used first), or None."""
    try:
        key = _fingerprint(tokenizer)
        cached = _long.get(tokenizer)
        if cached is None or cached[0] != key:
            cached = (key, OrderedDict())
            _long[tokenizer] = cached
    except (AttributeError, TypeError):
        return None
    return cached[1]


def _encode_by_pieces(tokenizer: Any, pattern: re.Pattern[str], texts: Sequence[str]) -> list[list[int]]:
    split = [split_pieces(pattern, t) for t in texts]
    cache: dict[str, list[int]] = dict.fromkeys(p for pieces in split for p in pieces)  # type: ignore[arg-type]
    kept = _long_pieces(tokenizer)  # a system prompt and tools every conversation repeats: encoded once
    known = {p: kept[p] for p in cache if len(p) >= LONG_PIECE and p in kept} if kept is not None else {}
    distinct = [p for p in cache if p not in known]
    cache.update(zip(distinct, encode_plain(tokenizer, distinct)))
    cache.update(known)
    if kept is not None:
        for p in cache:
            if len(p) >= LONG_PIECE:
                kept[p] = cache[p]
                kept.move_to_end(p)
        while len(kept) > LONG_PIECES:
            kept.popitem(last=False)
    out = []
    for pieces in split:
        ids: list[int] = []
        for p in pieces:
            ids += cache[p]
        out.append(ids)
    return out


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text's ids, exactly as :func:`encode_plain`; a piece shared by several texts (the history
    the prompts of one conversation repeat) is encoded once, where the tokenizer allows it."""
    pattern = piece_splitter(tokenizer)
    if pattern is None:
        return encode_plain(tokenizer, texts)
    return _encode_by_pieces(tokenizer, pattern, texts)


def split_between(tokenizer: Any, left: str, right: str) -> bool:
    """True when the tokenizer surely cuts ``left + right`` between the two (an added token ends
    ``left`` or starts ``right``, and none straddles the join): then encoding them together gives
    ``ids(left) + ids(right)``. False means "not known", never "they merge"."""
    pattern = piece_splitter(tokenizer)
    if pattern is None or not left or not right:
        return False
    # Two text pieces meeting at the join would be one piece of the whole: the lists differ.
    return split_pieces(pattern, left + right) == split_pieces(pattern, left) + split_pieces(pattern, right)
