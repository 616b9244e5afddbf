"""Checks that rows read from disk are rows ``onepass prepare`` could have written, before training on them.

Why this module exists: ``train`` takes a prepared folder on trust, and a hand-edited or foreign one
trains silently wrong (a ``kv_end`` that lets views see each other, NaN or negative weights, a weight on
an ignored target) or dies deep in torch (a token id past the embedding: a raw ``IndexError``). One pass
of numpy over all rows at once (no Python per token) refuses such data with one line naming the row and
the column. The invariants (docs/design.md), for a row of length L and ``q`` in ``0..L-1``::

    lengths       every column has L entries, L >= 1
    input_ids     0 <= id < vocab_size
    targets       -100, or 0 <= id < vocab_size
    weights       finite, >= 0, and 0 where targets == -100
    position_ids  the depth of a depth-first (pre-order) walk: 0 at q = 0, then at most one more than
                  the position before (a packed row starts again at 0)
    kv_end        q < kv_end[q] <= L, and kv_end[q] is the end of q's subtree: every position in
                  (q, kv_end[q]) is deeper than q and the one at kv_end[q] (when < L) is not

Example, the 6-token tree of docs/design.md (two views sharing ``h t``)::

    q            0 1 2 3 4 5
    position_ids 0 1 2 3 2 3
    kv_end       6 6 4 4 6 6      q=2: 3 is deeper, 4 is not -> subtree [2, 4): kv_end 4

:func:`check_rows` is the fast path (the tree part is :mod:`onepass.geometry`'s: kv_end a tree whose
depths are position_ids); :func:`row_problem` checks one row with plain loops, the reference the tests
compare it with. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from onepass.errors import DataError
from onepass.geometry import depths, tree_breaks
from onepass.tree import COLUMNS, IGNORE, Layout


PREPARE_AGAIN = "prepare the data again with `onepass prepare`"  # what to do about a bad prepared row


class RowError(DataError):
    """A prepared row that breaks an invariant of the row format; the message names row and column."""


def row_problem(row: Layout, vocab_size: int | None = None) -> str | None:
    """Slow reference: the first broken invariant of ``row`` as ``"column: what"``, or None."""
    lengths = {c: len(getattr(row, c)) for c in COLUMNS}
    if len(set(lengths.values())) != 1:
        return "lengths: columns differ in length (" + ", ".join(f"{c} {n}" for c, n in lengths.items()) + ")"
    n = lengths["input_ids"]
    if n == 0:
        return "lengths: the row is empty"
    ids, pos, end, tgt, w = (getattr(row, c).tolist() for c in COLUMNS)
    for q in range(n):
        if not 0 <= ids[q] < (vocab_size if vocab_size is not None else float("inf")):
            return f"input_ids: position {q} holds {ids[q]}, outside the vocabulary of {vocab_size}"
        if tgt[q] != IGNORE and not 0 <= tgt[q] < (vocab_size if vocab_size is not None else float("inf")):
            return f"targets: position {q} holds {tgt[q]}, outside the vocabulary of {vocab_size}"
        if not (np.isfinite(w[q]) and w[q] >= 0):
            return f"weights: position {q} holds {w[q]} (weights must be finite and >= 0)"
        if tgt[q] == IGNORE and w[q] != 0:
            return f"weights: position {q} has weight {w[q]} on an ignored target (-100)"
    for q in range(n):
        if pos[q] < 0 or pos[q] > (pos[q - 1] + 1 if q else 0):
            return f"position_ids: position {q} holds {pos[q]}, not a depth-first depth (0 first, then at most " \
                   "one more than the position before)"
    for q in range(n):
        if not q < end[q] <= n:
            return f"kv_end: position {q} holds {end[q]}, outside ({q}, {n}]"
        true_end = next((r for r in range(q + 1, n) if pos[r] <= pos[q]), n)
        if end[q] != true_end:
            return f"kv_end: position {q} holds {end[q]}, but its subtree (by position_ids) ends at {true_end}"
    return None


def check_rows(rows: Iterable[Layout], *, vocab_size: int | None = None, source: str = "rows",
               chunk_tokens: int = 1 << 20, require_weight: bool = True, start: int = 0,
               hint: str = PREPARE_AGAIN) -> int:
    """Raise :class:`RowError` naming the first bad row (0-based, in order) and column; else the number of rows.

    ``rows``: any iterable (a list, or rows read one batch at a time from a dataset: they are checked
    ``chunk_tokens`` tokens at a time, a row longer than that alone, so memory stays bounded).
    ``vocab_size``: the model's (ids must be below it); None checks only that ids are >= 0.
    ``require_weight``: some row must have a positive weight (else training learns nothing); off for
    rows that are scored, not trained on their weights (RL). ``start``: the number of the first row;
    ``hint``: what to do, said after the problem.
    """
    first, positive = start, False
    for chunk in _chunks(rows, chunk_tokens):
        lengths = np.array([[len(getattr(r, c)) for c in COLUMNS] for r in chunk], dtype=np.int64)
        bad = np.flatnonzero((lengths != lengths[:, :1]).any(axis=1) | (lengths[:, 0] == 0))
        bad_row, any_weight = (int(bad[0]), False) if len(bad) else _first_bad(chunk, vocab_size)
        if bad_row is not None:
            _raise(chunk[bad_row], first + bad_row, vocab_size, source, hint)
        positive |= any_weight
        first += len(chunk)
    if first > start and require_weight and not positive:
        raise RowError(f"{source}: no row has a positive weight, so training would learn nothing")
    return first - start


def _chunks(rows: Iterable[Layout], chunk_tokens: int) -> Iterator[list[Layout]]:
    """Consecutive rows of about ``chunk_tokens`` tokens together (a longer row alone)."""
    chunk: list[Layout] = []
    tokens = 0
    for row in rows:
        chunk.append(row)
        tokens += len(row.input_ids)
        if tokens >= chunk_tokens:
            yield chunk
            chunk, tokens = [], 0
    if chunk:
        yield chunk


def _first_bad(rows: Sequence[Layout], vocab_size: int | None) -> tuple[int | None, bool]:
    """(index of the first row that breaks an invariant or None, whether any weight is positive)."""
    n = np.array([len(r) for r in rows], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    row_of = np.repeat(np.arange(len(rows)), n)
    q = np.arange(int(n.sum())) - starts[row_of]  # position inside its row
    ids, pos, end, tgt, w = (np.concatenate([getattr(r, c) for r in rows]) for c in COLUMNS)
    limit = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
    real = tgt != IGNORE
    with np.errstate(invalid="ignore"):
        wrong = (ids < 0) | (ids >= limit) | (real & ((tgt < 0) | (tgt >= limit)))
        wrong |= ~np.isfinite(w) | (w < 0) | (~real & (w != 0))
        positive = bool((w > 0).any())
    prev = np.concatenate([[0], pos[:-1]])
    wrong |= (pos < 0) | np.where(q == 0, pos != 0, pos > prev + 1)
    row_len = n[row_of]
    wrong |= (end <= q) | (end > row_len)
    if not wrong.any():  # ranges are sane: the rows, as documents of one forest, are trees of depths pos
        forest = starts[row_of] + end  # (a tree is fixed by its depth-first depths: kv_end is then exact)
        wrong = tree_breaks(forest) | (depths(forest) != pos)
    bad_at = np.flatnonzero(wrong)
    return (int(row_of[bad_at[0]]) if len(bad_at) else None), positive


def check_ids(rows: Sequence[Layout], vocab_size: int, *, source: str = "rows") -> None:
    """Raise :class:`RowError` naming the first row whose input or target ids reach ``vocab_size`` (the
    model's embedding rows): a cheap second look once the model is known (:func:`check_rows` ran first)."""
    top = np.array([max(int(r.input_ids.max()), int(r.targets.max())) for r in rows], dtype=np.int64)
    bad = np.flatnonzero(top >= vocab_size)
    if len(bad):
        _raise(rows[int(bad[0])], int(bad[0]), vocab_size, source, PREPARE_AGAIN)


def model_vocab(model: Any) -> int | None:
    """How many ids ``model`` embeds (its input embedding's rows): the bound every row's ids are checked
    against; None for a model without an input embedding."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _raise(row: Layout, i: int, vocab_size: int | None, source: str, hint: str) -> None:
    problem = row_problem(row, vocab_size)
    assert problem is not None, f"check_rows and row_problem disagree on row {i}"
    raise RowError(f"{source}: row {i}, {problem}; {hint}")


__all__ = ["RowError", "check_ids", "check_rows", "model_vocab", "row_problem"]
