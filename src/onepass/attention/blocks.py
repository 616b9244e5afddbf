"""Plans from ``kv_end`` that let attention skip what the mask hides, in O(L), never L x L.

Two plans, one per kind of kernel:

- :class:`BlockPlan` (FlexAttention, any device): which (query block, key
  block) tiles are empty, partial or full; :func:`block_mask` turns it into a
  ``BlockMask`` directly.
- :class:`SegmentPlan` (the CPU path, :mod:`onepass.attention.cpu`): the row
  cut into chains whose queries see their ancestors in full and themselves
  causally, tiled for a dense attention kernel.

Tile plan. A block-sparse kernel (FlexAttention) skips empty
tiles and runs fully visible tiles without evaluating the mask. Asking
``create_block_mask`` for that classification evaluates the ``mask_mod`` on
all L x L pairs; under the one rule of the layout::

    query q may attend to key k   <=>   k <= q < kv_end[k]

it follows from O(L) per-block reductions of ``kv_end`` instead:

- The queries that see key k are the interval [k, kv_end[k]). For the keys of
  one block, consecutive k, these intervals chain (kv_end[k] >= k + 1), so the
  queries seeing *any* key of key block n are one interval
  [first key of n, max kv_end over n). A tile is non-empty iff its query
  block meets that interval.
- A tile is FULL iff every key is visible to every query: the last key of the
  key block <= the first query of the query block, and min kv_end over the key
  block > the last query. Tiles cut by the row end are never full (FlexAttention
  pads them with masked pairs), exactly as ``create_block_mask`` decides.

Cost: O(L) reductions plus O(M * N) comparisons for M x N tiles, the size of
the ``BlockMask`` itself. :func:`block_mask` then builds FlexAttention's
``BlockMask`` directly (``BlockMask.from_kv_blocks``) on the device the caller
names.

Worked example: a trunk ``h h``, a hidden branch ``t t`` (reasoning a later
turn does not see) and the next turn ``r r``, block size 2::

    p       0 1 2 3 4 5 6 7          q\\k  0 1 2 3 4 5 6 7     tiles   k0 k1 k2 k3
    token   h h t t r r r r          0     x                   q0      p  .  .  .
    kv_end  8 8 4 4 8 8 8 8          1     x x                 q1      F  p  .  .
                                     2     x x x               q2      F  .  p  .
                                     3     x x x x             q3      F  .  F  p
                                     4     x x     x
                                     5     x x     x x         F full, p partial,
                                     6     x x     x x x       . empty (skipped)
                                     7     x x     x x x x

Segment plan. A *segment* is a maximal chain of consecutive positions in
which each node's parent is the previous position (p - 1 is the parent of p
iff ``kv_end[p - 1] > p``). The queries of a segment [s, e) see exactly its
own keys causally and the ancestors of s, all of them (subtrees nest). Above:
segment [0, 4) ``h h t t`` has no ancestors; segment [4, 8) ``r r r r`` sees
ancestors [0, 2) ``h h``. Each segment is cut into query chunks of ``chunk``
tokens; chunk [a, b) of segment [s, e) is two tiles, a causal square on its
own diagonal and a no-mask rectangle against ``ancestors + [s, a)``::

    segment [4, 8), chunk 2:   diagonal  q [4, 6) x k [4, 6) causal
                               rectangle q [4, 6) x k (0 1)         (ancestors, no own prefix yet)
                               diagonal  q [6, 8) x k [6, 8) causal
                               rectangle q [6, 8) x k (0 1 4 5)

Sliding windows (``q`` sees ``k`` only if also ``pos[q] - pos[k] < W``, see
:mod:`onepass.attention.mask`). Positions are depths in the tree (+ a constant
per tree), so the keys a query sees through a window are its ancestors from
index ``window_start[q]`` on, the ancestor at depth ``depth[q] - W + 1``
(:func:`onepass.attention.window.window_start`, O(L log L))::

    query q may attend to key k   <=>   window_start[q] <= k <= q < kv_end[k]

- Tiles: FULL also needs ``max window_start`` over the query block <= the
  block's first key (exact); a tile is skipped when the tree skips it or when
  ``min window_start`` over the query block is past its last key. That is
  exact for chains and packed documents; a query block that straddles two
  branches can keep a tile PARTIAL that holds no visible pair (the
  ``mask_mod`` hides it; never the reverse).
- Segments: a segment's keys (ancestors, then its own positions) are exactly
  the path from the root, so key j of the list has depth j and query q (list
  index depth[q]) sees keys (depth[q] - W, depth[q]]: a band. Chunks are cut
  to at most W - 1 queries, so a diagonal square is never cut by the window
  and every query of a chunk still sees the key just before it; a rectangle
  covers only keys [depth[q0] - W + 1, depth[q0]) and carries a mask
  (:meth:`SegmentPlan.rect_visible`) where the window cuts it.

Legend: B rows, L row length, M query blocks, N key blocks (M == N here), S
segments, T = B * L (rows flattened into one), G chunks in a bucket, C bucket
width, R rectangles. Numpy only; torch is imported inside :func:`block_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from onepass.attention.window import as_positions_BL, check_window, window_start

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockPlan:
    """Tile classes for rows of ``length`` tokens in blocks of ``block_size``.

    kind_BMN  int8 [B, M, N]: EMPTY (0, skipped), PARTIAL (1, mask evaluated), FULL (2, no mask)
    """

    block_size: int
    length: int
    kind_BMN: np.ndarray
    window: int | None = None

    @property
    def num_partial(self) -> int:
        return int((self.kind_BMN == PARTIAL).sum())

    @property
    def num_full(self) -> int:
        return int((self.kind_BMN == FULL).sum())

    @property
    def num_empty(self) -> int:
        return int((self.kind_BMN == EMPTY).sum())

    def grid(self, row: int = 0) -> str:
        """ASCII picture of one row's tiles (``F`` full, ``p`` partial, ``.`` empty)."""
        chars = np.array([".", "p", "F"])
        return "\n".join(" ".join(chars[line]) for line in self.kind_BMN[row])


def as_kv_end_BL(kv_end: Any) -> np.ndarray:
    """``kv_end`` ([L] or [B, L], numpy / list / tensor) as a checked int64 numpy ``[B, L]``.

    Raises ValueError unless ``p < kv_end[p] <= L`` everywhere (every node sees
    itself and nothing past its row).
    """
    if hasattr(kv_end, "detach"):
        kv_end = kv_end.detach().cpu().numpy()
    kv_end_BL = np.asarray(kv_end, dtype=np.int64)
    if kv_end_BL.ndim == 1:
        kv_end_BL = kv_end_BL[None]
    if kv_end_BL.ndim != 2 or kv_end_BL.shape[1] == 0:
        raise ValueError(f"kv_end must be [L] or [B, L] with L > 0, got shape {kv_end_BL.shape}")
    L = kv_end_BL.shape[1]
    pos_L = np.arange(L)
    bad = (kv_end_BL <= pos_L) | (kv_end_BL > L)
    if bad.any():
        b, p = np.argwhere(bad)[0]
        raise ValueError(f"kv_end[{b}, {p}] = {kv_end_BL[b, p]} is outside ({p}, {L}]: every node must "
                         "see itself and nothing past the row end (pad with kv_end[p] = p + 1)")
    return kv_end_BL


def block_plan(kv_end: Any, block_size: int = 128, *, position_ids: Any = None,
               window: int | None = None) -> BlockPlan:
    """Classify every tile of ``kv_end`` ([L] or [B, L]) without materialising L x L.

    With a sliding ``window`` (in positions; ``position_ids`` shaped like ``kv_end``), tiles the
    window hides are skipped too.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    kv_end_BL = as_kv_end_BL(kv_end)
    B, L = kv_end_BL.shape
    N = -(-L // block_size)
    padded_BNS = np.pad(kv_end_BL, ((0, 0), (0, N * block_size - L))).reshape(B, N, block_size)
    end_max_BN = padded_BNS.max(-1)  # a pad (kv_end 0) sees nothing and never raises the max
    end_min_BN = padded_BNS.min(-1)  # ... and drives the min of a cut block to 0: never full
    first_N = np.arange(N) * block_size
    last_N = np.minimum(first_N + block_size, L) - 1
    whole_N = first_N + block_size <= L
    # query block m (rows, index [:, None]) against key block n (columns, index [None, :])
    any_BMN = (last_N[:, None] >= first_N[None, :]) & (first_N[:, None] < end_max_BN[:, None, :])
    full_BMN = ((whole_N[:, None] & whole_N[None, :] & (last_N[None, :] <= first_N[:, None]))
                & (end_min_BN[:, None, :] > last_N[:, None]))
    if window is not None:  # queries of block m see keys from min / max window_start on
        window = check_window(window)
        start_BL = window_start(kv_end_BL, position_ids, window)
        pad = N * block_size - L
        start_min_BM = np.pad(start_BL, ((0, 0), (0, pad)), constant_values=L).reshape(B, N, -1).min(-1)
        start_max_BM = np.pad(start_BL, ((0, 0), (0, pad)), constant_values=0).reshape(B, N, -1).max(-1)
        any_BMN = any_BMN & (start_min_BM[:, :, None] <= last_N[None, None, :])
        full_BMN = full_BMN & (start_max_BM[:, :, None] <= first_N[None, None, :])
    kind_BMN = any_BMN.astype(np.int8) + full_BMN.astype(np.int8)
    return BlockPlan(block_size=block_size, length=L, kind_BMN=kind_BMN, window=window)


def block_plan_reference(kv_end: Any, block_size: int = 128, *, position_ids: Any = None,
                         window: int | None = None) -> BlockPlan:
    """Slow, obviously correct: build the dense L x L mask and reduce each tile with any / all."""
    kv_end_BL = as_kv_end_BL(kv_end)
    B, L = kv_end_BL.shape
    N = -(-L // block_size)
    pos = np.arange(L)
    mask_BQK = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, :, None] < kv_end_BL[:, None, :])
    if window is not None:
        pos_BL = as_positions_BL(position_ids, (B, L))
        mask_BQK &= (pos_BL[:, :, None] - pos_BL[:, None, :]) < window
    pad = N * block_size - L
    tiles = np.pad(mask_BQK, ((0, 0), (0, pad), (0, pad))).reshape(B, N, block_size, N, block_size)
    any_BMN = tiles.any(axis=(2, 4))
    full_BMN = tiles.all(axis=(2, 4))
    kind_BMN = any_BMN.astype(np.int8) + full_BMN.astype(np.int8)
    return BlockPlan(block_size=block_size, length=L, kind_BMN=kind_BMN, window=window)


def _ordered(blocks_BMN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count per query block, key-block indices with the selected ones first, ascending).

    The same order as FlexAttention's own ``argsort(descending=True, stable=True)``.
    """
    num_BM = blocks_BMN.sum(-1, dtype=np.int32)
    idx_BMN = np.argsort(~blocks_BMN, axis=-1, kind="stable").astype(np.int32)
    return num_BM, idx_BMN


def block_mask_from_plan(plan: BlockPlan, kv_end: Any, *, device: torch.device | str | None = None,
                         position_ids: Any = None) -> BlockMask:
    """FlexAttention ``BlockMask`` (shared by all heads) from ``plan``, on ``device``.

    ``kv_end`` (and, for a windowed plan, ``position_ids``) are the plan's own;
    they back the ``mask_mod`` that the kernel evaluates on partial tiles.
    ``device`` defaults to ``kv_end``'s device for a tensor, else CPU.
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    from onepass.attention.mask import generate_tree_mask_mod

    if device is None:
        device = kv_end.device if isinstance(kv_end, torch.Tensor) else "cpu"
    checked_BL = as_kv_end_BL(kv_end)
    if isinstance(kv_end, torch.Tensor):  # keep the caller's tensor (no host round trip for the mask_mod)
        kv_end_BL = kv_end.to(device=device, dtype=torch.long).reshape(checked_BL.shape)
    else:
        kv_end_BL = torch.as_tensor(checked_BL, device=device)
    if kv_end_BL.shape[1] != plan.length or kv_end_BL.shape[0] != plan.kind_BMN.shape[0]:
        raise ValueError(f"kv_end of shape {tuple(kv_end_BL.shape)} does not belong to a plan of "
                         f"{plan.kind_BMN.shape[0]} rows of {plan.length}")
    pos_BL = None
    if plan.window is not None:  # a tensor stays on its device; anything else goes through numpy
        pos_BL = (position_ids.to(device=device, dtype=torch.long).reshape(checked_BL.shape)
                  if isinstance(position_ids, torch.Tensor)
                  else torch.as_tensor(as_positions_BL(position_ids, checked_BL.shape), device=device))
    num_BM, idx_BMN = _ordered(plan.kind_BMN == PARTIAL)
    full_num_BM, full_idx_BMN = _ordered(plan.kind_BMN == FULL)

    def put(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(x[:, None], device=device)  # [B, 1 head, ...]

    return BlockMask.from_kv_blocks(put(num_BM), put(idx_BMN), put(full_num_BM), put(full_idx_BMN),
                                    BLOCK_SIZE=plan.block_size,
                                    mask_mod=generate_tree_mask_mod(kv_end_BL, pos_BL, plan.window),
                                    seq_lengths=(plan.length, plan.length))


def block_mask(kv_end: Any, *, block_size: int = 128, device: torch.device | str | None = None,
               position_ids: Any = None, window: int | None = None) -> BlockMask:
    """The tree ``BlockMask`` for ``kv_end`` ([L] or [B, L]), built from :func:`block_plan`.

    Equals ``onepass.attention.mask.tree_block_mask`` (``create_block_mask``) tile for tile,
    without evaluating the mask on L x L pairs (with a window: the same FULL tiles, no visible
    tile skipped; see the module docstring).
    """
    plan = block_plan(kv_end, block_size, position_ids=position_ids, window=window)
    return block_mask_from_plan(plan, kv_end, device=device, position_ids=position_ids)


# ---------------------------------------------------------------------------------------------
# Segment plan (the CPU path)


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentPlan:
    """Rows flattened to T = B * L positions, as chains and the tiles that cover their visible pairs.

    seg_start_S, seg_stop_S  int64 [S]: segment i is [start, stop)
    anc_ptr_S1, anc_index    ancestors of segment i: anc_index[anc_ptr[i]:anc_ptr[i + 1]], ascending
    diag_runs_R3             int64 [R, 3]: (start, n, width): n consecutive diagonal chunks of width
    diag_buckets             int64 [G, C] each: the other diagonal chunks, -1 past a chunk's end
    rect_R4                  int64 [R, 4]: (segment, query start, query stop, key stop), keys taken from
                             ancestors + own positions of the segment, in that order
    rect_lo_R                int64 [R]: the rectangle's first key in that list (0 without a window)
    window                   the sliding window (in positions) the plan was cut for, or None
    """

    num_rows: int
    row_length: int
    chunk: int
    seg_start_S: np.ndarray
    seg_stop_S: np.ndarray
    anc_ptr_S1: np.ndarray
    anc_index: np.ndarray
    diag_runs_R3: np.ndarray
    diag_buckets: tuple[np.ndarray, ...]
    rect_R4: np.ndarray
    rect_lo_R: np.ndarray
    window: int | None = None

    @property
    def num_segments(self) -> int:
        return len(self.seg_start_S)

    @property
    def num_kernel_calls(self) -> int:
        """Attention kernel calls per layer and direction (forward or backward)."""
        return len(self.diag_runs_R3) + len(self.diag_buckets) + len(self.rect_R4)

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs of the mask (what the tiles compute, up to bucket padding).

        Counted from the segments; equals :func:`onepass.flops.visible_pairs` of ``kv_end``
        (``tests/test_flops.py``).
        """
        n_S = self.seg_stop_S - self.seg_start_S
        return int((n_S * (n_S + 1) // 2).sum() + (n_S * np.diff(self.anc_ptr_S1)).sum())

    def keys(self, i: int) -> np.ndarray:
        """Key positions of segment i's rectangles: its ancestors, then its own positions."""
        anc = self.anc_index[self.anc_ptr_S1[i]:self.anc_ptr_S1[i + 1]]
        return np.concatenate([anc, np.arange(self.seg_start_S[i], self.seg_stop_S[i])])

    def rect_visible(self, r: int) -> np.ndarray | None:
        """Bool ``[n, keys]``: the pairs of rectangle r the window keeps; None when it keeps them all.

        Query ``q0 + a`` has list index ``key stop + a`` (its depth) and sees list indices
        above ``key stop + a - window``.
        """
        if self.window is None:
            return None
        _, q0, q1, hi = self.rect_R4[r].tolist()
        lo = int(self.rect_lo_R[r])
        if lo > hi + (q1 - q0 - 1) - self.window:  # even the last query sees the first key
            return None
        return np.arange(lo, hi)[None, :] > (hi + np.arange(q1 - q0))[:, None] - self.window


def segment_plan(kv_end: Any, *, chunk: int = 128, position_ids: Any = None,
                 window: int | None = None) -> SegmentPlan:
    """Segments, ancestors and tiles of ``kv_end`` ([L] or [B, L]) in O(L + S log L).

    With a sliding ``window`` (``position_ids`` shaped like ``kv_end``), chunks
    are at most ``window - 1`` queries and rectangles start at the window.
    Raises ValueError when subtrees do not nest (not a tree layout): the plan
    relies on it.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    kv_end_BL = as_kv_end_BL(kv_end)
    if window is not None:
        window = check_window(window)
        window_start(kv_end_BL, position_ids, window)  # checks positions = depths
        chunk = min(chunk, max(window - 1, 1))  # every query of a chunk sees the key just before it
    B, L = kv_end_BL.shape
    kv_T = (kv_end_BL + (np.arange(B) * L)[:, None]).reshape(-1)  # rows become documents of one row
    T = B * L
    pos_T = np.arange(T)
    is_start_T = np.ones(T, dtype=bool)
    is_start_T[1:] = kv_T[:-1] == pos_T[1:]  # p - 1 is a leaf: p starts a new chain
    if (kv_T[1:] > kv_T[:-1])[~is_start_T[1:]].any():
        raise ValueError("kv_end does not describe a tree: a node's subtree ends after its parent's")
    start_S = np.flatnonzero(is_start_T)
    stop_S = np.append(start_S[1:], T)
    covered_T = np.zeros(T, dtype=bool)  # some earlier node's subtree holds p: p has a parent
    covered_T[1:] = np.maximum.accumulate(kv_T)[:-1] > pos_T[1:]

    ancestors: dict[int, np.ndarray] = {}
    stack: list[int] = []
    neg_kv_T = -kv_T  # non-decreasing along a chain: searchsorted finds the attach point
    busy = np.flatnonzero(covered_T[start_S] | (kv_T[start_S] > stop_S))  # the rest: no parent, no child
    for i in busy.tolist():
        s = int(start_S[i])
        while stack and kv_T[start_S[stack[-1]]] <= s:
            stack.pop()
        if covered_T[s]:
            if not stack:
                raise ValueError(f"kv_end does not describe a tree: position {s} is covered by no chain")
            j = stack[-1]
            sj, ej = int(start_S[j]), int(stop_S[j])
            a = sj + int(np.searchsorted(neg_kv_T[sj:ej], -s, side="left")) - 1  # last node of j holding s
            if kv_T[s] > kv_T[a]:
                raise ValueError(f"kv_end does not describe a tree: the subtree of {s} ends after its parent's")
            ancestors[i] = np.concatenate([ancestors.get(j, pos_T[:0]), np.arange(sj, a + 1)])
        if kv_T[s] > stop_S[i]:
            stack.append(i)

    S = len(start_S)
    num_anc_S = np.zeros(S, dtype=np.int64)
    for i, anc in ancestors.items():
        num_anc_S[i] = len(anc)
    anc_ptr_S1 = np.concatenate([[0], np.cumsum(num_anc_S)])
    anc_index = np.concatenate([ancestors[i] for i in sorted(ancestors)]) if ancestors else pos_T[:0]

    # tiles: chunks of each segment; a diagonal square each, a rectangle where there are earlier keys
    n_S = stop_S - start_S
    num_chunks_S = -(-n_S // chunk)
    seg_R = np.repeat(np.arange(S), num_chunks_S)
    first_R = np.arange(len(seg_R)) - np.repeat(np.cumsum(num_chunks_S) - num_chunks_S, num_chunks_S)
    q0_R = start_S[seg_R] + first_R * chunk
    q1_R = np.minimum(q0_R + chunk, stop_S[seg_R])
    keys_R = num_anc_S[seg_R] + (q0_R - start_S[seg_R])  # = depth of q0: the list is the root path
    lo_R = np.zeros_like(keys_R) if window is None else np.maximum(keys_R - window + 1, 0)
    rect_R4 = np.stack([seg_R, q0_R, q1_R, keys_R], axis=1)[keys_R > lo_R]
    # diagonals: the whole chunks of a segment are one batch (a strided view of the row); the rest
    # (short segments, last chunks) run in buckets of similar width, padded at the end (a causal
    # query never sees a later key)
    num_whole_S = n_S // chunk
    whole = np.flatnonzero(num_whole_S)
    runs_R3 = np.stack([start_S[whole], num_whole_S[whole], np.full(len(whole), chunk)], axis=1)
    rest_q0 = start_S + num_whole_S * chunk
    rest = np.flatnonzero(rest_q0 < stop_S)
    width_R = stop_S[rest] - rest_q0[rest]
    bucket_R = np.where(width_R == 1, 1, np.minimum(chunk, -(-width_R // 16) * 16))
    buckets = []
    for width in np.unique(bucket_R).tolist():
        sel = rest[bucket_R == width]
        idx_GC = rest_q0[sel, None] + np.arange(width)
        buckets.append(np.where(idx_GC < stop_S[sel, None], idx_GC, -1))
    return SegmentPlan(num_rows=B, row_length=L, chunk=chunk, seg_start_S=start_S, seg_stop_S=stop_S,
                       anc_ptr_S1=anc_ptr_S1, anc_index=anc_index, diag_runs_R3=runs_R3.reshape(-1, 3),
                       diag_buckets=tuple(buckets), rect_R4=rect_R4, rect_lo_R=lo_R[keys_R > lo_R],
                       window=window)


def plan_pairs_reference(plan: SegmentPlan) -> np.ndarray:
    """Slow check of a plan: int [T, T], how many tiles compute each (query, key) pair (must be 0/1;
    pairs a rectangle's window mask hides are not counted)."""
    T = plan.num_rows * plan.row_length
    count = np.zeros((T, T), dtype=np.int64)
    for start, num, width in plan.diag_runs_R3.tolist():
        for a in range(start, start + num * width, width):
            count[a:a + width, a:a + width] += np.tri(width, dtype=np.int64)
    for idx_GC in plan.diag_buckets:
        for idx in idx_GC:
            idx = idx[idx >= 0]
            count[np.ix_(idx, idx)] += np.tri(len(idx), dtype=np.int64)
    for r, (i, q0, q1, num_keys) in enumerate(plan.rect_R4.tolist()):
        visible = plan.rect_visible(r)
        count[q0:q1, plan.keys(i)[plan.rect_lo_R[r]:num_keys]] += 1 if visible is None else visible
    return count
