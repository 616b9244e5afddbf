"""Shared test helpers: hypothesis strategies, small fixed layouts, synthetic training conversations."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import strategies as st

from onepass.attention.mask import pad_kv_end
from onepass.layout.geometry import parents
from onepass.layout.tree import build_layout, concat
from onepass.layout.view import View

DOC_EXAMPLE = [8, 8, 4, 4, 8, 8, 8, 8]  # h h | t t (hidden later) | r r r r
# h a b | d d2 | d3 | f with a -> {b, d, f}, d -> {d2, d3}: d3's ancestors h a d are two ranges
SCATTERED = [7, 7, 3, 6, 5, 6, 7]


def V(tokens, num_prompt):
    return View(tokens=np.asarray(tokens, dtype=np.int64), num_prompt=num_prompt, turn=0)


def random_views(max_len: int):
    """1-4 views over a 4-token vocabulary (lots of shared prefixes, branches and duplicated nodes)."""
    return st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=max_len), st.integers(0, max_len)),
        min_size=1, max_size=4,
    ).map(lambda specs: [V(t, min(k, len(t))) for t, k in specs])


views_st = random_views(12)
layout_st = views_st.map(build_layout)


def any_dfs_order(kv_end, seed: int) -> np.ndarray:
    """``kv_end`` of the same forest laid out depth-first with its siblings in a random order.

    build_layout puts the heaviest child first, so its rows keep each branch's ancestors in one range;
    rows prepared by other versions or tools need not, and the kernels must be exact for any order.
    """
    kv_end = np.asarray(kv_end)
    L, rng = len(kv_end), random.Random(seed)
    children: list[list[int]] = [[] for _ in range(L + 1)]  # index L: the forest's roots
    for p, parent in enumerate(parents(kv_end).tolist()):
        children[parent if parent >= 0 else L].append(p)
    order, stack = [], [L]
    while stack:
        node = stack.pop()
        order.append(node)
        kids = children[node][:]
        rng.shuffle(kids)
        stack.extend(reversed(kids))
    order = np.asarray(order[1:])
    return np.arange(L) + (kv_end - np.arange(L))[order]  # a node's subtree size moves with it


def batch_strategy(max_extra_pad: int):
    """kv_end [B, L] of packed rows of trees, padded to a common length plus up to ``max_extra_pad``;
    half of the rows in a random depth-first order (:func:`any_dfs_order`), not build_layout's."""
    def rows(spec):
        kv = [concat(row).kv_end for row in spec[0]]
        kv = [any_dfs_order(k, spec[2]) if (spec[2] + b) % 2 else k for b, k in enumerate(kv)]
        return pad_kv_end(kv, max(len(k) for k in kv) + spec[1])

    return st.tuples(st.lists(st.lists(layout_st, min_size=1, max_size=3), min_size=1, max_size=3),
                     st.integers(0, max_extra_pad), st.integers(0, 2**16)).map(rows)


# --- conversations for the training tests (test_train, test_trainer) ---

WORDS = "the of a to is in that it for on with as was at by an be this from or have not are but".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def synthetic_conversations(num: int, seed: int = 0) -> list[dict]:
    """Reasoning conversations of 1-4 turns; some turns have empty reasoning (still trained)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        messages = []
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": _text(rng, rng.randint(3, 12))})
            reasoning = "" if rng.random() < 0.25 else _text(rng, rng.randint(4, 16))
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(2, 10)),
                             "reasoning_content": reasoning})
        out.append({"messages": messages})
    return out
