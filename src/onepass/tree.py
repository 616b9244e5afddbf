"""Views merged into a prefix tree, laid out depth-first: the one-pass layout.

Why this module exists: it is the whole method. A shared prefix of several
views is stored once; where they diverge the tree branches. In depth-first
order every subtree is a contiguous range, so the attention mask is one rule::

    query q may attend to key k   <=>   k <= q < kv_end[k]

Worked example (the paper's shape in miniature): view A = [h | t r] (prompt
h; trains reasoning t and response r) and view B = [h r | s] (the answer r
is history in B's prompt; trains s). ``h`` is shared; targets are already
shifted (node p predicts targets[p])::

    p  token pos kv_end target      mask (row q, col k)   h  t  r  r  s
    0  h     0   5      t                              h  x
    1  t     1   3      r                              t  x  x
    2  r     2   3      -                              r  x  x  x
    3  r     1   5      s                              r  x        x
    4  s     2   5      -                              s  x        x  x

Two views that train *different* next tokens at the same node cannot share
it (a node holds one target), so the tree duplicates that node (a sibling
with the same token); two views that train the *same* target there share it
and their weights add, as their two N-pass loss terms would.

No torch here: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.render import View

IGNORE = -100  # the target of a position that trains nothing

# The canonical row format: column names and their dtypes in memory. A prepared dataset stores
# the integer columns as int32 on disk (ROW_DISK_DTYPES, Arrow value types) and the weights as
# float64, so turn/conversation weights (1/n) survive prepare -> train exactly; reading casts
# back to ROW_SCHEMA.
ROW_SCHEMA: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64),
    "position_ids": np.dtype(np.int64),
    "kv_end": np.dtype(np.int64),
    "targets": np.dtype(np.int64),
    "weights": np.dtype(np.float64),
}
ROW_DISK_DTYPES: dict[str, str] = {c: "float64" if dtype.kind == "f" else "int32" for c, dtype in ROW_SCHEMA.items()}
COLUMNS = tuple(ROW_SCHEMA)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The canonical row format. All arrays have the same length L.

    input_ids     token of node p
    position_ids  depth of p (its index inside every view that holds it)
    kv_end        one past the last node of p's subtree (row coordinates)
    targets       the next token a view trains at p (already shifted), else -100
    weights       loss weight of that target (0 where targets == -100)
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    kv_end: np.ndarray
    targets: np.ndarray
    weights: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE).sum())

    def to_dict(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in COLUMNS}


def row_from_columns(item: Mapping[str, Any]) -> Layout:
    """One row given as columns (lists or arrays, any int / float width) as a :class:`Layout`
    with the dtypes of :data:`ROW_SCHEMA`: how every reader of stored or collated rows builds one."""
    return Layout(**{c: np.asarray(item[c], dtype=dtype) for c, dtype in ROW_SCHEMA.items()})


def rows_to_columns(rows: Sequence[Layout]) -> dict[str, list[np.ndarray]]:
    """Rows as columns (one list per name of :data:`ROW_SCHEMA`): what a dataset is built from."""
    return {c: [getattr(r, c) for r in rows] for c in COLUMNS}


def concat(layouts: Sequence[Layout]) -> Layout:
    """Pack layouts into one row: kv_end is offset, so documents never see each other."""
    assert layouts, "concat needs at least one layout"
    offsets = np.cumsum([0] + [len(x) for x in layouts[:-1]])
    return Layout(
        input_ids=np.concatenate([x.input_ids for x in layouts]),
        position_ids=np.concatenate([x.position_ids for x in layouts]),
        kv_end=np.concatenate([x.kv_end + o for x, o in zip(layouts, offsets)]),
        targets=np.concatenate([x.targets for x in layouts]),
        weights=np.concatenate([x.weights for x in layouts]),
    )


def view_targets(view: View) -> np.ndarray:
    """Per-position shifted targets of one view: tokens[i+1] where i+1 is a completion token."""
    n = len(view.tokens)
    targets = np.full(n, IGNORE, dtype=np.int64)
    first = max(view.num_prompt, 1)  # a completion token at position 0 has nothing to predict it from
    targets[first - 1:n - 1] = view.tokens[first:]
    return targets


class PrefixTree:
    """A trie of views. Insert views, then :meth:`layout` flattens it depth-first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.targets: list[int] = []
        self.weights: list[float] = []
        self.children: list[dict[int, list[int]]] = []
        self.roots: dict[int, list[int]] = {}
        self.num_views = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def _match(self, siblings: dict[int, list[int]], token: int, target: int, following: int | None
               ) -> int | None:
        """A sibling holding ``token`` whose target does not conflict with ``target``.

        Among several, prefer one that already has a child ``following`` (the
        view's next token), so a view reuses the branch it continues.
        """
        found = None
        for node in siblings.get(token, ()):
            t = self.targets[node]
            if t == IGNORE or target == IGNORE or t == target:
                if following is None or following in self.children[node]:
                    return node
                found = node if found is None else found
        return found

    @staticmethod
    def _walk(view: View) -> list[tuple[int, int, int | None]]:
        tokens = view.tokens.tolist()
        targets = view_targets(view).tolist()
        nexts: list[int | None] = tokens[1:] + [None]
        return list(zip(tokens, targets, nexts))

    def count_new(self, view: View) -> int:
        """How many nodes inserting ``view`` would add (the tree is unchanged)."""
        siblings = self.roots
        for i, (token, target, following) in enumerate(self._walk(view)):
            node = self._match(siblings, token, target, following)
            if node is None:
                return len(view.tokens) - i
            siblings = self.children[node]
        return 0

    def insert(self, view: View, weight: float = 1.0) -> int:
        """Add ``view``; its trained targets get ``weight`` each. Returns the nodes added."""
        before = len(self.tokens)
        self.insert_path(view, weight)
        return len(self.tokens) - before

    def insert_path(self, view: View, weight: float = 1.0) -> list[int]:
        """Add ``view``; returns the node id of each of its positions (root first)."""
        siblings = self.roots
        path = []
        for token, target, following in self._walk(view):
            node = self._match(siblings, token, target, following)
            if node is None:
                node = len(self.tokens)
                self.tokens.append(token)
                self.targets.append(IGNORE)
                self.weights.append(0.0)
                self.children.append({})
                siblings.setdefault(token, []).append(node)
            if target != IGNORE:
                self.targets[node] = target
                self.weights[node] += weight
            siblings = self.children[node]
            path.append(node)
        self.num_views += 1
        return path

    def dfs_order(self) -> np.ndarray:
        """Node ids in layout order: depth-first pre-order, children in insertion order."""
        order = []
        stack = _ordered(self.roots)[::-1]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(_ordered(self.children[node])[::-1])
        return np.asarray(order, dtype=np.int64)

    def layout(self) -> Layout:
        """Depth-first flattening (see :meth:`dfs_order`)."""
        n = len(self.tokens)
        order = self.dfs_order()
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        depth = np.zeros(n, dtype=np.int64)  # by row position; parents precede children
        end = np.arange(1, n + 1, dtype=np.int64)  # by row position
        for node in order:  # pre-order: a parent's depth is set before its children's
            p = rank[node]
            for c in _ordered(self.children[node]):
                depth[rank[c]] = depth[p] + 1
        for node in order[::-1]:  # reverse pre-order: children's ends are final first
            p = rank[node]
            for c in _ordered(self.children[node]):
                end[p] = max(end[p], end[rank[c]])
        tokens = np.asarray(self.tokens, dtype=np.int64)
        targets = np.asarray(self.targets, dtype=np.int64)
        weights = np.asarray(self.weights, dtype=np.float64)
        return Layout(input_ids=tokens[order], position_ids=depth, kv_end=end,
                      targets=targets[order], weights=weights[order])


def _ordered(siblings: dict[int, list[int]]) -> list[int]:
    """Sibling node ids in insertion order (node ids grow with insertion)."""
    return sorted(node for nodes in siblings.values() for node in nodes)


def build_layout(views: Sequence[View], weights: Sequence[float] | None = None) -> Layout:
    """Merge ``views`` into one prefix tree and lay it out. ``weights[i]`` per target of view i."""
    tree = PrefixTree()
    for i, view in enumerate(views):
        tree.insert(view, 1.0 if weights is None else float(weights[i]))
    return tree.layout()


def ancestors_reference(layout: Layout, q: int) -> list[int]:
    """Slow reference: keys visible to query q, by walking parents (from position ids)."""
    # The parent of p is the nearest earlier node one level up whose subtree holds p.
    out = [q]
    p = q
    while layout.position_ids[p] > 0:
        k = p - 1
        while not (layout.position_ids[k] == layout.position_ids[p] - 1 and layout.kv_end[k] > p):
            k -= 1
        out.append(k)
        p = k
    return out[::-1]
