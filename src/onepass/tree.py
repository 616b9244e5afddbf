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

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.geometry import row_chains
from onepass.view import View

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
    """A trie of views. Insert views (or laid-out trees: :meth:`insert_layout`, how trees of several
    conversations become one, :mod:`onepass.share`), then :meth:`layout` flattens it depth-first.

    Node ids grow with insertion, and the nodes a view's insertion adds are a chain of consecutive ids
    (a *segment*: once a view leaves the tree, the rest of it is new; a laid-out tree adds one segment
    per chain of it that leaves the tree). :meth:`layout` lays the tree
    out a run of a segment at a time (numpy ranges, no per-node Python); :meth:`layout_reference` walks it
    node by node, the obviously-correct version it is tested against.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.targets: list[int] = []
        self.weights: list[float] = []
        # children by token; None for a node inside a chain, whose only child is node + 1 (see _kids)
        self.children: list[dict[int, list[int]] | None] = []
        self.roots: dict[int, list[int]] = {}
        self.num_views = 0
        self._segments: list[tuple[int, int, int]] = []  # (first node, parent node or -1, depth of first)
        self._starts: list[int] = []  # first node of each segment, ascending (segments are runs of ids)
        self._branched: list[int] = []  # nodes inside a segment that got a children dict, ascending

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
                if following is None or following in self._kids(node):
                    return node
                found = node if found is None else found
        return found

    def count_new(self, view: View) -> int:
        """How many nodes inserting ``view`` would add (the tree is unchanged)."""
        targets = view_targets(view)
        return self._descend(view.tokens.tolist(), targets.tolist(), _trained(targets), 0, len(view.tokens), -1,
                             commit=False)

    def insert(self, view: View, weight: float = 1.0) -> int:
        """Add ``view``; its trained targets get ``weight`` each. Returns the nodes added."""
        before = len(self.tokens)
        self.insert_path(view, weight)
        return len(self.tokens) - before

    def insert_path(self, view: View, weight: float = 1.0) -> list[int]:
        """Add ``view``; returns the node id of each of its positions (root first)."""
        targets = view_targets(view)
        ids = np.empty(len(view.tokens), dtype=np.int64)
        self._descend(view.tokens.tolist(), targets.tolist(), _trained(targets), 0, len(ids), -1, weights=float(weight),
                      ids=ids)
        self.num_views += 1
        return ids.tolist()

    def insert_layout(self, layout: Layout) -> np.ndarray:
        """Merge a laid-out tree (or forest: any valid row) into this tree; the node id of each row position.

        A row node joins the existing node with the same path of tokens from the root and a target that
        does not conflict (as a view's token does in :meth:`insert_path`), its target and weight added;
        once a branch of the row finds no such node, it and everything below it are new. The loss of
        the tree then holds every term of the row's, on the same context: this is how trees of several
        conversations that share a prefix become one (:mod:`onepass.share`)."""
        n = len(layout)
        ids = np.empty(n, dtype=np.int64)
        tokens, targets = layout.input_ids.tolist(), layout.targets.tolist()
        weights, depth = layout.weights.tolist(), layout.position_ids.tolist()
        trained = _trained(layout.targets)
        chains = row_chains(layout.kv_end)
        grown = [False] * len(chains)  # the chain left the tree: every chain below it is new
        for c, chain in enumerate(chains):
            a, b = chain.start, chain.end
            parent = int(ids[chains[chain.parent].end - 1]) if chain.parent >= 0 else -1
            if chain.parent >= 0 and grown[chain.parent]:
                ids[a:b] = self._add_chain(tokens[a:b], targets[a:b], weights[a:b], self._kids(parent), parent,
                                           depth=depth[a])
                grown[c] = True
            else:
                grown[c] = self._descend(tokens, targets, trained, a, b, parent, weights=weights, ids=ids,
                                         depth=depth) > 0
        return ids

    def _descend(self, tokens: list[int], targets: list[int], trained: list[int], i: int, end: int, node: int, *,
                 weights: float | list[float] = 1.0, ids: np.ndarray | None = None, depth: Sequence[int] | None = None,
                 commit: bool = True) -> int:
        """Walk ``tokens[i:end]`` (each the child of the one before; the first a child of ``node``, -1: a
        root) down the tree, matching nodes while they match; the rest becomes one new chain. Returns the
        number of new nodes. ``weights``: each trained target's (one for all, or per position);
        ``trained``: the positions whose target is not IGNORE, ascending; ``depth``: of each position
        (default: its index); ``commit=False`` only counts (:meth:`count_new`).

        Inside a chain (a node whose one child is the next id) the matching runs over the whole run at
        once (:meth:`_run`); elsewhere node by node (:meth:`_match`): the same choices either way.
        """
        tree_targets = self.targets
        while i < end:
            if node >= 0 and self.children[node] is None:  # inside a chain: compare the run of ids at once
                m = min(self._run_end(node) - node, end - i)
                k = self._run(node + 1, tokens, targets, trained, i, m)
                if k:
                    if commit:
                        self._train(node + 1, i, k, targets, weights, trained)
                        ids[i:i + k] = np.arange(node + 1, node + 1 + k)
                    node, i = node + k, i + k
                    continue
                siblings = self._kids(node) if commit else {self.tokens[node + 1]: [node + 1]}
            else:
                siblings = self.roots if node < 0 else self._kids(node)
            token, target = tokens[i], targets[i]
            nodes = siblings.get(token)
            match = None
            if nodes is not None:
                if len(nodes) == 1:  # what _match decides for a single candidate, inlined (hot loop)
                    t = tree_targets[nodes[0]]
                    if t == IGNORE or target == IGNORE or t == target:
                        match = nodes[0]
                else:
                    match = self._match(siblings, token, target, tokens[i + 1] if i + 1 < end else None)
            if match is None:  # the walk leaves the tree here: the rest is one new chain
                if commit:
                    w = weights[i:end] if isinstance(weights, list) else weights
                    ids[i:end] = self._add_chain(tokens[i:end], targets[i:end], w, siblings, node,
                                                 depth=i if depth is None else depth[i])
                return end - i
            if commit:
                self._train(match, i, 1, targets, weights, trained)
                ids[i] = match
            node, i = match, i + 1
        return 0

    def _run_end(self, node: int) -> int:
        """The last node of the run of ids that starts at ``node`` (inside a chain) and in which each node's
        only child is the next id: the next node with a children dict (a branch, or its segment's end)."""
        j = bisect.bisect_right(self._starts, node)
        last = (self._starts[j] if j < len(self._starts) else len(self.tokens)) - 1
        k = bisect.bisect_left(self._branched, node)
        return min(last, self._branched[k]) if k < len(self._branched) else last

    def _run(self, first: int, tokens: list[int], targets: list[int], trained: list[int], i: int, m: int) -> int:
        """How many of nodes ``first, first + 1, ...`` (at most ``m``) hold ``tokens[i:]`` with targets that
        do not conflict. Where no position of the run is trained, the tokens alone decide (a list compare)."""
        j = bisect.bisect_left(trained, i)
        plain = j == len(trained) or trained[j] >= i + m
        if plain and self.tokens[first:first + m] == tokens[i:i + m]:
            return m
        ok = np.asarray(self.tokens[first:first + m]) == np.asarray(tokens[i:i + m])
        if not plain:
            have, want = np.asarray(self.targets[first:first + m]), np.asarray(targets[i:i + m])
            ok &= (have == IGNORE) | (want == IGNORE) | (have == want)
        return m if ok.all() else int(np.argmin(ok))

    def _train(self, first: int, i: int, k: int, targets: list[int], weights: float | list[float],
               trained: list[int]) -> None:
        """Nodes ``first .. first + k - 1`` hold positions ``i .. i + k - 1``: their trained targets and weights."""
        for j in range(bisect.bisect_left(trained, i), bisect.bisect_left(trained, i + k)):
            p = trained[j]
            node = first + p - i
            self.targets[node] = targets[p]
            self.weights[node] += weights[p] if isinstance(weights, list) else weights

    def _kids(self, node: int) -> dict[int, list[int]]:
        """The children of ``node`` by token; a node inside a chain gets its dict only when asked."""
        kids = self.children[node]
        if kids is None:
            kids = self.children[node] = {self.tokens[node + 1]: [node + 1]}
            bisect.insort(self._branched, node)
        return kids

    def _add_chain(self, tokens: list[int], targets: list[int], weights: float | list[float],
                   siblings: dict[int, list[int]], parent: int, *, depth: int) -> range:
        """New nodes for ``tokens``, each the only child of the one before; the first joins ``siblings``."""
        first = len(self.tokens)
        ids = range(first, first + len(tokens))
        self.tokens.extend(tokens)
        self.targets.extend(targets)
        if isinstance(weights, list):
            self.weights.extend([0.0 if t == IGNORE else w for t, w in zip(targets, weights)])
        else:
            self.weights.extend([0.0 if t == IGNORE else weights for t in targets])
        self.children.extend([None] * (len(tokens) - 1))  # inside the chain: the child is the next id
        self.children.append({})
        siblings.setdefault(tokens[0], []).append(first)
        self._segments.append((first, parent, depth))
        self._starts.append(first)
        return ids

    def _preorder(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Node ids in layout order, with the depth and kv_end of each row position, by runs of a segment.

        A node's children are visited heaviest subtree first, ties in id order (its own segment's
        next node has the smallest id). A segment is therefore laid out in runs: a run ends at a
        node where an attached segment is heavier than the rest of the run's own subtree; that
        node's children follow in their order, and the lighter segments attached inside the run
        follow the whole subtree of the run, deepest attachment first.
        """
        segs = self._segments
        n = len(self.tokens)
        starts = [a for a, _, _ in segs]
        ends = starts[1:] + [n]
        at: list[dict[int, list[int]]] = [{} for _ in segs]  # per segment: node -> attached child segments
        roots = []
        for j, (_, parent, _) in enumerate(segs):
            if parent < 0:
                roots.append(j)
            else:
                at[bisect.bisect_right(starts, parent) - 1].setdefault(parent, []).append(j)
        size_N = np.zeros(n, dtype=np.int64)  # subtree size of every node
        for j in range(len(segs) - 1, -1, -1):  # a child segment is created after its parent's
            a, b = starts[j], ends[j]
            extra = np.zeros(b - a, dtype=np.int64)
            for node, kids in at[j].items():
                extra[node - a] = sum(int(size_N[starts[c]]) for c in kids)
            size_N[a:b] = np.arange(b - a, 0, -1) + np.cumsum(extra[::-1])[::-1]

        def visit_order(tasks: list[tuple[int, int]]) -> list[tuple[int, int]]:  # heaviest first, then by id
            return sorted(tasks, key=lambda task: (-int(size_N[task[1]]), task[1]))

        nodes = [sorted(at_j) for at_j in at]  # per segment, ascending: its nodes with attached segments
        splits = [[node for node in nodes[j]  # those where a run ends (a heavier child, or the segment's end)
                   if node + 1 == ends[j] or max(int(size_N[starts[c]]) for c in at[j][node]) > size_N[node + 1]]
                  for j in range(len(segs))]
        order, depth, kv_end = [], [], []
        stack = visit_order([(j, starts[j]) for j in roots])[::-1]  # tasks: (segment, first node of the run)
        pos = 0
        while stack:
            j, x0 = stack.pop()
            a, b = starts[j], ends[j]
            k = bisect.bisect_left(splits[j], x0)
            y = splits[j][k] if k < len(splits[j]) else b - 1  # the run is x0 .. y
            m = y + 1 - x0
            order.append(np.arange(x0, y + 1))
            depth.append(np.arange(segs[j][2] + x0 - a, segs[j][2] + y + 1 - a))
            kv_end.append(pos + np.arange(m) + size_N[x0:y + 1])
            pos += m
            inside = nodes[j][bisect.bisect_left(nodes[j], x0):bisect.bisect_left(nodes[j], y)]
            for node in inside:  # lighter than the run: after its subtree
                stack.extend(visit_order([(c, starts[c]) for c in at[j][node]])[::-1])
            kids = [(c, starts[c]) for c in at[j].get(y, [])] + ([(j, y + 1)] if y + 1 < b else [])
            stack.extend(visit_order(kids)[::-1])
        if not order:
            return (np.zeros(0, dtype=np.int64),) * 3
        return np.concatenate(order), np.concatenate(depth), np.concatenate(kv_end)

    def dfs_order(self) -> np.ndarray:
        """Node ids in layout order: depth-first pre-order, heaviest child first (ties: insertion order).

        Heaviest first keeps the largest subtree's path contiguous: in a multi-turn conversation
        the shared history is one run of the row and each turn's completion branches off it, so
        a branch's ancestors are one range (the CPU kernel takes them as a view, not a gather,
        and FlexAttention sees full blocks). Any depth-first order gives the same loss.
        """
        return self._preorder()[0]

    def layout(self) -> Layout:
        """Depth-first flattening (see :meth:`dfs_order`)."""
        return self.layout_and_rank()[0]

    def layout_and_rank(self) -> tuple[Layout, np.ndarray]:
        """:meth:`layout`, and the row position of every node id (what :meth:`insert_path` and
        :meth:`insert_layout` return are node ids)."""
        order, depth, end = self._preorder()
        tokens = np.asarray(self.tokens, dtype=np.int64)
        targets = np.asarray(self.targets, dtype=np.int64)
        weights = np.asarray(self.weights, dtype=np.float64)
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return Layout(input_ids=tokens[order], position_ids=depth, kv_end=end,
                      targets=targets[order], weights=weights[order]), rank

    def subtree_sizes_reference(self) -> list[int]:
        """Nodes in each node's subtree, itself included, node by node (a child's id exceeds its parent's)."""
        size = [1] * len(self.tokens)
        for node in range(len(self.tokens) - 1, -1, -1):
            size[node] += sum(size[c] for c in _ordered(self._kids(node)))
        return size

    def dfs_order_reference(self) -> np.ndarray:
        """Slow reference of :meth:`dfs_order`: a stack of nodes."""
        size = self.subtree_sizes_reference()
        order = []
        stack = _heaviest_first(_ordered(self.roots), size)[::-1]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(_heaviest_first(_ordered(self._kids(node)), size)[::-1])
        return np.asarray(order, dtype=np.int64)

    def layout_reference(self) -> Layout:
        """Slow reference of :meth:`layout`: node by node, depth and subtree end from the children."""
        n = len(self.tokens)
        order = self.dfs_order_reference()
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        depth = np.zeros(n, dtype=np.int64)  # by row position; parents precede children
        end = np.arange(1, n + 1, dtype=np.int64)  # by row position
        for node in order:  # pre-order: a parent's depth is set before its children's
            p = rank[node]
            for c in _ordered(self._kids(node)):
                depth[rank[c]] = depth[p] + 1
        for node in order[::-1]:  # reverse pre-order: children's ends are final first
            p = rank[node]
            for c in _ordered(self._kids(node)):
                end[p] = max(end[p], end[rank[c]])
        tokens = np.asarray(self.tokens, dtype=np.int64)
        targets = np.asarray(self.targets, dtype=np.int64)
        weights = np.asarray(self.weights, dtype=np.float64)
        return Layout(input_ids=tokens[order], position_ids=depth, kv_end=end,
                      targets=targets[order], weights=weights[order])


def _trained(targets: np.ndarray) -> list[int]:
    """The positions whose target is not IGNORE, ascending."""
    return np.flatnonzero(np.asarray(targets) != IGNORE).tolist()


def _ordered(siblings: dict[int, list[int]]) -> list[int]:
    """Sibling node ids in insertion order (node ids grow with insertion)."""
    return sorted(node for nodes in siblings.values() for node in nodes)


def _heaviest_first(nodes: list[int], size: Sequence[int]) -> list[int]:
    """``nodes`` (in insertion order) by subtree size, largest first; a stable sort keeps ties in order."""
    return sorted(nodes, key=lambda node: -size[node])


def build_layout(views: Sequence[View], weights: Sequence[float] | None = None) -> Layout:
    """Merge ``views`` into one prefix tree and lay it out. ``weights[i]`` per target of view i."""
    tree = PrefixTree()
    for i, view in enumerate(views):
        tree.insert(view, 1.0 if weights is None else float(weights[i]))
    return tree.layout()


def count_nodes(views: Sequence[View]) -> int:
    """How many nodes the prefix tree of ``views`` has (``len(build_layout(views))``), without laying it out."""
    tree = PrefixTree()
    for view in views:
        tree.insert(view)
    return len(tree)


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
