"""Trees of different conversations that share a token prefix, merged into one tree per row.

Why this module exists: one-pass shares what the views of one conversation have in common, and
stopped at the edge of the conversation. Agent and tool-calling data repeat a long system prompt
and the tool schemas in every conversation (3.8k tokens of the 7.4k of a tau-bench airline tree),
and an RL batch repeats each group's prompt. A packed row that holds several such trees computes
that prefix once per tree; merged into one tree (:meth:`onepass.layout.tree.PrefixTree.insert_layout`), it
is computed once per row::

    conversation A   S S S a1 a2          S: a system prompt and tools both begin with
    conversation B   S S S b1             (a1 a2 and b1 are each tree's own nodes)
    packed today     S S S a1 a2 S S S b1      9 tokens, kv_end keeps the two trees apart
    shared           S S S a1 a2 b1            6 tokens, b1 sees S S S and not a1 a2

Exact: a node of the merged tree has the same tokens from the root (so the same positions and
the same hidden state, for attention, windows and recurrent chains alike) as every node it stands
for, and holds their targets, never two different ones, with their weights added: the loss is the
sum of the same terms. Targets and weights are each view's own (its weighting was applied when
its conversation's trees were made), so a shared prefix trains nothing unless a view trains it.
:func:`loss_terms` reads the terms back from rows, to compare.

Which trees share a tree (:func:`share_trees`):

- only trees whose first :data:`SHARE_MIN` tokens agree (every conversation of a template begins
  with a few tokens such as ``<|im_start|>system``; merging for those would change rows for nothing);
- never two trees of the same conversation (``units``): a schedule that split a conversation into
  several trees (``k-pass``, ``budget``) meant them to be separate forward passes;
- within a window of ``window`` consecutive conversations (in data order), sorted by their prefix
  (:func:`prefix_key`) so that trees with a long common prefix meet; a group grows while its tree
  fits ``max_tokens``, so a group too large for one row is split into rows that each hold the
  shared prefix once.

The merged trees are then packed like any trees (:func:`onepass.layout.pack.best_fit_decreasing`). A tree
that shares with no other is kept exactly as it was, so data without shared prefixes gives the rows
it gave before.

No torch here: numpy only.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from onepass.layout.geometry import parents, root_path, segment_starts
from onepass.layout.pack import best_fit_decreasing
from onepass.layout.tree import IGNORE, Layout, PrefixTree, concat

SHARE_MIN = 64  # trees share a tree only when at least this many first tokens agree
KEY_LENGTHS = tuple(SHARE_MIN << j for j in range(11))  # 64 .. 65,536: the prefix lengths a key tells apart

Key = tuple[int, ...]


def first_path(layout: Layout) -> np.ndarray:
    """The tokens of a row's first segment: the root path of its first leaf (in a tree laid out
    heaviest child first, the longest history), which every other path of the tree branches off."""
    starts = np.flatnonzero(segment_starts(layout.kv_end)[1:])
    return layout.input_ids[:int(starts[0]) + 1 if len(starts) else len(layout)]


def prefix_key(layout: Layout) -> Key | None:
    """Hashes of the first ``64, 128, ..., 65536`` tokens of :func:`first_path` (the whole path where it
    is shorter), or None when it is shorter than :data:`SHARE_MIN` tokens (the tree shares with none).

    Two trees whose first n tokens agree have equal keys up to the longest length <= n, so sorting by
    key puts trees with a long common prefix side by side, deepest first, in O(1) memory per tree.

    >>> a = Layout(input_ids=np.arange(100), position_ids=np.arange(100), kv_end=np.full(100, 100),
    ...            targets=np.full(100, -100), weights=np.zeros(100))
    >>> b = Layout(**{**a.to_dict(), "input_ids": np.r_[np.arange(70), np.zeros(30, dtype=np.int64)]})
    >>> ka, kb = prefix_key(a), prefix_key(b)
    >>> ka[0] == kb[0], ka[1] == kb[1], prefix_key(Layout(**{c: v[:10] for c, v in a.to_dict().items()}))
    (True, False, None)
    """
    path = first_path(layout)
    if len(path) < SHARE_MIN:
        return None
    data = np.ascontiguousarray(path, dtype=">i4").tobytes()  # big-endian: bytes order as tokens do
    h = hashlib.blake2b(digest_size=8)
    key, done = [], 0
    for n in KEY_LENGTHS:
        h.update(data[4 * done:4 * n])
        done = min(n, len(path))
        key.append(int.from_bytes(h.copy().digest(), "big"))
    return tuple(key)


def window_order(keys: Sequence[Key | None], units: Sequence[int], window: int | None) -> list[int]:
    """Indices of ``keys`` in the order :func:`share_trees` groups them: windows of ``window``
    consecutive conversations (``units``, non-decreasing; None: one window), each window's trees sorted
    by key (stable), trees without a key last."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[int] = []
    start = 0
    for end in range(1, len(keys) + 1):
        if end == len(keys) or _window(units[end], window) != _window(units[start], window):
            out.extend(sorted(range(start, end), key=lambda i: (keys[i] is None, keys[i] or (), i)))
            start = end
    return out


def _window(unit: int, window: int | None) -> int:
    return 0 if window is None else unit // window


@dataclass(frozen=True, kw_only=True, slots=True)
class Merged:
    """One tree of the trees ``members`` (indices of the input): the input tree itself when alone.

    ``positions[j]``: the row position in ``layout`` of every position of tree ``members[j]``."""

    layout: Layout
    members: tuple[int, ...]
    positions: tuple[np.ndarray, ...]


def _merge(layouts: Sequence[Layout]) -> tuple[Layout, list[np.ndarray]]:
    tree = PrefixTree()
    ids = [tree.insert_layout(x) for x in layouts]
    layout, rank = tree.layout_and_rank()
    return layout, [rank[i] for i in ids]


def merge_layouts(layouts: Sequence[Layout]) -> Layout:
    """One prefix tree of ``layouts`` (each a tree or a forest), laid out heaviest child first."""
    return _merge(layouts)[0]


def share_trees(keys: Sequence[Key | None], units: Sequence[int], read: Callable[[int], Layout],
                max_tokens: int, *, window: int | None = None) -> Iterator[Merged]:
    """Trees ``0 .. len(keys) - 1`` (``read(i)``: tree i, of conversation ``units[i]``, with
    ``keys[i] = prefix_key(read(i))``) grouped and merged (see the module doc), in the order of
    :func:`window_order`; every input tree is in exactly one :class:`Merged`, and every merged tree
    has at most ``max_tokens`` nodes (an input tree over it is a caller bug). Deterministic: a
    function of the keys, units and trees only.

    A group's tree grows as trees join it; a tree that would take it over ``max_tokens`` closes the
    group and opens the next one (the grown tree is then built again without it).
    """
    group: list[int] = []
    members: list[Layout] = []
    ids: list[np.ndarray] = []
    seen: set[int] = set()
    tree, spoilt = PrefixTree(), False

    def close() -> Iterator[Merged]:
        if len(group) == 1:
            yield Merged(layout=members[0], members=(group[0],), positions=(np.arange(len(members[0])),))
        elif group:
            if spoilt:
                layout, positions = _merge(members)
            else:
                layout, rank = tree.layout_and_rank()
                positions = [rank[x] for x in ids]
            assert len(layout) <= max_tokens
            yield Merged(layout=layout, members=tuple(group), positions=tuple(positions))

    for i in window_order(keys, units, window):
        x = read(i)
        assert len(x) <= max_tokens, f"tree {i} has {len(x)} tokens, more than max_tokens={max_tokens}"
        key, first = keys[i], keys[group[0]] if group else None
        if key is not None and first is not None and key[0] == first[0] and units[i] not in seen \
                and _window(units[group[0]], window) == _window(units[i], window):
            fits = len(tree) + len(x) <= max_tokens  # surely fits; else try (shared nodes may make it fit)
            placed = tree.insert_layout(x)
            if fits or len(tree) <= max_tokens:
                group.append(i)
                members.append(x)
                ids.append(placed)
                seen.add(units[i])
                continue
            spoilt = True
        yield from close()
        group, members, seen, tree, spoilt = [i], [x], {units[i]}, PrefixTree(), False
        ids = [tree.insert_layout(x)] if key is not None else []
    yield from close()


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedRows:
    """Rows of shared trees, and where each input tree's positions went: ``where[i] = (row, positions)``;
    ``groups``: the input trees of each merged tree (one for a tree that shares with none)."""

    rows: list[Layout]
    where: list[tuple[int, np.ndarray]]
    groups: list[tuple[int, ...]]

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def merge_shared(trees: Sequence[Layout], units: Sequence[int] | None, max_tokens: int, *,
                 window: int | None = None) -> list[Merged]:
    """The trees of :func:`share_trees` for trees held in memory: ``units[i]`` is the conversation of tree i
    (None: each its own). What :func:`share_and_pack` packs, and what a caller packs with other rows (TRL's
    documents beside conversations in ``OnePassTrainer``)."""
    units = list(range(len(trees))) if units is None else list(units)
    return list(share_trees([prefix_key(x) for x in trees], units, trees.__getitem__, max_tokens, window=window))


def share_and_pack(trees: Sequence[Layout], units: Sequence[int] | None, max_tokens: int, *,
                   window: int | None = None) -> SharedRows:
    """Trees merged where they share a prefix (:func:`merge_shared`), then packed best-fit decreasing
    into rows of at most ``max_tokens``. ``units[i]``: the conversation of tree i (None: each its own)."""
    merged = merge_shared(trees, units, max_tokens, window=window)
    bins = best_fit_decreasing([len(m.layout) for m in merged], max_tokens)
    rows: list[Layout] = []
    where: list[tuple[int, np.ndarray]] = [(0, np.zeros(0, dtype=np.int64))] * len(trees)
    for r, b in enumerate(bins):
        offset = 0
        for g in b:
            for i, positions in zip(merged[g].members, merged[g].positions):
                where[i] = (r, positions + offset)
            offset += len(merged[g].layout)
        rows.append(concat([merged[g].layout for g in b]))
    return SharedRows(rows=rows, where=where, groups=[m.members for m in merged])


def share_rows(trees: Sequence[Layout], units: Sequence[int] | None, max_tokens: int, *,
               window: int | None = None) -> list[Layout]:
    """The rows of :func:`share_and_pack`."""
    return share_and_pack(trees, units, max_tokens, window=window).rows


# ---------------------------------------------------------------------------------------------
# the loss terms of rows: what sharing must keep

_MOD = (1 << 61) - 1
_BASES = (1_000_003, 998_244_353)


def loss_terms(rows: Sequence[Layout]) -> dict[tuple[int, int, int, int], float]:
    """The weighted loss terms rows hold: ``(context hash, context hash 2, depth, target) -> weight``.

    A trained position contributes ``weight * CE(logits(context), target)``, where the context is the
    tokens on its root path (itself included: the same tokens, the same positions, the same hidden
    state). Two sets of rows have the same loss and gradients when these agree (up to float addition
    order). The context is hashed twice, root to node (polynomial, mod 2^61 - 1), in O(L) per row;
    :func:`loss_terms_reference` keys the terms by the tokens themselves.
    """
    out: dict[tuple[int, int, int, int], float] = {}
    for row in rows:
        up = parents(row.kv_end).tolist()
        tokens, targets, weights = row.input_ids.tolist(), row.targets.tolist(), row.weights.tolist()
        depth = row.position_ids.tolist()
        h1, h2 = [0] * len(tokens), [0] * len(tokens)
        for p, (parent, token) in enumerate(zip(up, tokens)):
            a, b = (h1[parent], h2[parent]) if parent >= 0 else (0, 0)
            h1[p] = (a * _BASES[0] + token + 1) % _MOD
            h2[p] = (b * _BASES[1] + token + 1) % _MOD
            if targets[p] != IGNORE:
                key = (h1[p], h2[p], depth[p], targets[p])
                out[key] = out.get(key, 0.0) + weights[p]
    return out


def loss_terms_reference(rows: Sequence[Layout]) -> dict[tuple[tuple[int, ...], int], float]:
    """Slow reference of :func:`loss_terms`: ``(context tokens, target) -> weight``."""
    out: dict[tuple[tuple[int, ...], int], float] = {}
    for row in rows:
        for p in np.flatnonzero(row.targets != IGNORE).tolist():
            key = (tuple(row.input_ids[root_path(row.kv_end, p)].tolist()), int(row.targets[p]))
            out[key] = out.get(key, 0.0) + float(row.weights[p])
    return out


def same_terms(a: dict, b: dict, *, rel: float = 1e-12) -> bool:
    """Whether two :func:`loss_terms` results hold the same terms with the same weights (to ``rel``)."""
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel, abs_tol=0.0) for k in a)
