"""Plans from ``kv_end`` that let attention skip what the mask hides, in O(L), never L x L.

This module: :class:`BlockPlan` (FlexAttention, any device): which (query
block, key block) tiles are empty, partial or full; :func:`onepass.attention.mask.block_mask` turns
it into a ``BlockMask`` directly. The other plan, for the CPU kernel, is
:mod:`onepass.attention.segments`.

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
the ``BlockMask`` itself. :func:`onepass.attention.mask.block_mask` then builds FlexAttention's
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

Sliding windows (``q`` sees ``k`` only if also ``pos[q] - pos[k] < W``, see
:mod:`onepass.attention.mask`). Positions are depths in the tree (+ a constant
per tree), so the keys a query sees through a window are its ancestors from
index ``window_start[q]`` on, the ancestor at depth ``depth[q] - W + 1``
(:func:`onepass.attention.window.window_start`, O(L log L))::

    query q may attend to key k   <=>   window_start[q] <= k <= q < kv_end[k]

- Tiles: FULL also needs ``max window_start`` over the query block <= the
  block's first key (exact); a tile is skipped when the tree skips it or when
  ``min window_start`` over the query block is past its last key. That is
  exact for rows without branches and packed documents; a query block that straddles two
  branches can keep a tile PARTIAL that holds no visible pair (the
  ``mask_mod`` hides it; never the reverse).

Legend: B rows, L row length, M query blocks, N key blocks (M == N here). Numpy only: the ``BlockMask`` built
from a plan is :func:`onepass.attention.mask.block_mask`'s (torch).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.attention.window import as_positions_BL, check_window, window_start

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


def ordered_blocks(blocks_BMN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count per query block, key-block indices with the selected ones first, ascending).

    The same order as FlexAttention's own ``argsort(descending=True, stable=True)``.
    """
    num_BM = blocks_BMN.sum(-1, dtype=np.int32)
    idx_BMN = np.argsort(~blocks_BMN, axis=-1, kind="stable").astype(np.int32)
    return num_BM, idx_BMN
