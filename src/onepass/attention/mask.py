"""Attention masks derived from ``kv_end``: dense (SDPA/eager) and FlexAttention.

Why this module exists: a row stores its whole attention pattern in one O(L)
column, ``kv_end``, under one rule::

    query q may attend to key k   <=>   k <= q < kv_end[k]

Every backend needs that rule in its own shape: a dense bool mask for SDPA, an
additive float mask for eager attention, a ``mask_mod``/``BlockMask`` for
FlexAttention. This module builds them all from ``kv_end`` on a device the
caller names, next to a slow double-loop reference the tests compare against.

Worked example: the paper's two-turn case as a tree. View 1 = [h1 | t1 r1],
view 2 = [h1 r1 h2 | t2 r2] (``|`` ends the prompt; t = reasoning, r = response).
The two copies of r1 are the trained one (``r1``, after t1) and the history one
(``r1'``, after h1). Laid out with t1's branch first (``build_layout`` puts the heavier
branch, ``r1' h2 t2 r2``, first: the same mask with rows and columns permuted; any
depth-first order is a valid layout)::

    p  token pos kv_end      q \\ k  h1 t1 r1 r1' h2 t2 r2
    0  h1    0   7           h1     x
    1  t1    1   3           t1     x  x
    2  r1    2   3           r1     x  x  x
    3  r1'   1   7           r1'    x          x
    4  h2    2   7           h2     x          x  x
    5  t2    3   7           t2     x          x  x  x
    6  r2    4   7           r2     x          x  x  x  x

Sliding windows. Transformers' N-pass rule for a windowed layer
(``masking_utils.sliding_window_overlay``) is ``kv_idx > q_idx - W``, i.e.
``q - k < W`` on token indices: a query sees itself and the W - 1 tokens
before it. In a view token indices are position ids, so in the tree the rule
is, on top of the tree rule::

    query q may attend to key k   <=>   k <= q < kv_end[k]  and  pos[q] - pos[k] < W

The example above with W = 3 (each query sees itself, its parent and its
grandparent; view 2's ``r2`` at position 4 sees positions 2..4 = h2 t2 r2,
exactly as in the plain view [h1 r1' h2 t2 r2])::

    q \\ k  h1 t1 r1 r1' h2 t2 r2
    h1     x
    t1     x  x
    r1     x  x  x
    r1'    x          x
    h2     x          x  x
    t2                x  x  x
    r2                   x  x  x

Which layers are windowed, and W, come from the config (read from
transformers 5.23's modeling code; :func:`onepass.attention.backends.layer_windows`):
``config.layer_types[i] == "sliding_attention"`` with ``W = config.sliding_window``
(gpt-oss: every other layer; OLMo-3: 3 of 4; Gemma 3: 5 of 6; Qwen2/Qwen3 with
``use_sliding_window``: layers ``i >= max_window_layers``); configs without
``layer_types`` (Mistral, Phi-3) window every layer when ``sliding_window`` is set.

Padding convention: rows of a batch are padded to a common length with
``kv_end[p] = p + 1`` (:func:`pad_kv_end`): a pad sees only itself and nothing
sees a pad, so no row of the mask is ever fully masked (SDPA would return NaN).

The seed paper's own layout and role-id mask live in :mod:`onepass.attention.paper`, as a
separate reference.

Shape suffixes: B batch, H heads, L row length, Q queries, K keys,
NQ/NK numbers of query/key blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from onepass.attention.blocks import FULL, PARTIAL, BlockPlan, as_kv_end_BL, block_plan, ordered_blocks
from onepass.attention.window import as_positions_BL, check_window
from onepass.batch import to_device

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


ArrayLike = np.ndarray | torch.Tensor | Sequence[int]


# ---------------------------------------------------------------------------------------------
# kv_end -> masks


def _as_kv_end(kv_end: ArrayLike, device: torch.device | str | None) -> torch.Tensor:
    if isinstance(kv_end, torch.Tensor):
        return kv_end.to(device=device or kv_end.device, dtype=torch.long)
    return torch.as_tensor(np.asarray(kv_end), dtype=torch.long, device=device)


def window_positions(kv_end_BL: torch.Tensor, position_ids: ArrayLike | None,
                     window: int | None) -> torch.Tensor | None:
    """``position_ids`` as a long tensor shaped like ``kv_end_BL`` on its device; None without a window."""
    if window is None:
        return None
    window = check_window(window)
    if position_ids is None:
        raise ValueError(f"a sliding window ({window}) needs the rows' position_ids: the window is measured "
                         "in positions, pos[q] - pos[k] < window")
    pos_BL = _as_kv_end(position_ids, kv_end_BL.device)
    if pos_BL.shape != kv_end_BL.shape:
        raise ValueError(f"position_ids of shape {tuple(pos_BL.shape)} do not match kv_end of shape "
                         f"{tuple(kv_end_BL.shape)}")
    return pos_BL


def dense_mask(kv_end: ArrayLike, *, device: torch.device | str | None = None,
               position_ids: ArrayLike | None = None, window: int | None = None) -> torch.Tensor:
    """Bool mask, True = may attend: ``[L] -> [Q=L, K=L]`` or ``[B, L] -> [B, Q, K]``, one broadcast.

    With a ``window``, also ``pos[q] - pos[k] < window`` (``position_ids`` shaped like
    ``kv_end``). ``device`` defaults to ``kv_end``'s device (CPU for numpy input).
    """
    kv_end_BL = _as_kv_end(kv_end, device)
    L = kv_end_BL.shape[-1]
    idx = torch.arange(L, device=kv_end_BL.device)
    q_Q1, k_1K = idx[:, None], idx[None, :]
    mask = (k_1K <= q_Q1) & (q_Q1 < kv_end_BL[..., None, :])
    pos_BL = window_positions(kv_end_BL, position_ids, window)
    if pos_BL is not None:
        mask &= (pos_BL[..., :, None] - pos_BL[..., None, :]) < window
    return mask


def dense_mask_reference(kv_end: ArrayLike, position_ids: ArrayLike | None = None,
                         window: int | None = None) -> np.ndarray:
    """Slow, obviously correct: ``mask[q, k] = k <= q < kv_end[k]`` (and ``pos[q] - pos[k] < window``
    with a window), one pair at a time. 1-D only."""
    kv_end = np.asarray(kv_end).tolist()
    L = len(kv_end)
    pos = np.asarray(position_ids).tolist() if window is not None else [0] * L
    mask = np.zeros((L, L), dtype=bool)
    for q in range(L):
        for k in range(L):
            mask[q, k] = k <= q < kv_end[k] and (window is None or pos[q] - pos[k] < window)
    return mask


def _as_B1QK(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype != torch.bool:
        raise ValueError(f"expected a bool mask (True = may attend), got {mask.dtype}")
    if mask.ndim == 2:
        return mask[None, None]
    if mask.ndim == 3:
        return mask[:, None]
    if mask.ndim == 4:
        return mask
    raise ValueError(f"expected a mask of shape [Q, K], [B, Q, K] or [B, 1, Q, K], got {tuple(mask.shape)}")


def sdpa_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, 1, Q, K]`` for ``scaled_dot_product_attention`` (True = attend) from a bool mask."""
    return _as_B1QK(mask)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float ``[B, 1, Q, K]`` for HF eager attention: 0 where visible, ``finfo(dtype).min`` where hidden."""
    mask_B1QK = _as_B1QK(mask)
    out_B1QK = torch.zeros(mask_B1QK.shape, dtype=dtype, device=mask_B1QK.device)
    return out_B1QK.masked_fill_(~mask_B1QK, torch.finfo(dtype).min)


def pad_kv_end(kv_ends: Sequence[ArrayLike], length: int) -> np.ndarray:
    """Stack rows into ``[B, length]``; padded positions get ``kv_end = p + 1`` (they see only themselves)."""
    out_BL = np.tile(np.arange(1, length + 1, dtype=np.int64), (len(kv_ends), 1))
    for b, kv_end in enumerate(kv_ends):
        kv_end = np.asarray(kv_end.cpu() if isinstance(kv_end, torch.Tensor) else kv_end, dtype=np.int64)
        if kv_end.ndim != 1 or len(kv_end) > length:
            raise ValueError(f"row {b}: kv_end of shape {kv_end.shape} does not fit a padded length of "
                             f"{length}; pass a length >= the longest row")
        out_BL[b, :len(kv_end)] = kv_end
    return out_BL


def block_any(mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-level view of a bool mask: ``[.., Q, K] -> [.., NQ, NK]``, True where any pair is visible.

    The last partial block is padded with False (what FlexAttention does).
    """
    Q, K = mask.shape[-2:]
    NQ, NK = -(-Q // block_size), -(-K // block_size)
    padded = torch.nn.functional.pad(mask, (0, NK * block_size - K, 0, NQ * block_size - Q))
    blocks = padded.reshape(*mask.shape[:-2], NQ, block_size, NK, block_size)
    return blocks.any(dim=-1).any(dim=-2)


# ---------------------------------------------------------------------------------------------
# FlexAttention


def generate_tree_mask_mod(kv_end_BL: torch.Tensor, position_ids_BL: torch.Tensor | None = None,
                           window: int | None = None) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod`` for rows ``kv_end_BL`` (a ``[B, L]`` tensor on the attention's device).

    With a ``window``: also ``pos[q] - pos[k] < window`` (``position_ids_BL`` on the same device).
    """
    if kv_end_BL.ndim != 2:
        raise ValueError(f"kv_end_BL must be [B, L], got shape {tuple(kv_end_BL.shape)}")
    pos_BL = window_positions(kv_end_BL, position_ids_BL, window)

    def tree_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < kv_end_BL[b, kv_idx])

    if pos_BL is None:
        return tree_mask_mod

    def windowed_tree_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                               kv_idx: torch.Tensor) -> torch.Tensor:
        return tree_mask_mod(b, h, q_idx, kv_idx) & (pos_BL[b, q_idx] - pos_BL[b, kv_idx] < window)

    return windowed_tree_mask_mod


def tree_block_mask(kv_end: ArrayLike, *, block_size: int = 128, device: torch.device | str | None = None,
                    position_ids: ArrayLike | None = None, window: int | None = None) -> BlockMask:
    """A FlexAttention ``BlockMask`` for ``kv_end`` (``[L]`` or ``[B, L]``), shared by all heads.

    Blocks with no visible pair are skipped by the kernel; fully visible blocks skip the
    ``mask_mod``. ``device`` defaults to ``kv_end``'s device. Nothing is compiled here.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    kv_end_BL = _as_kv_end(kv_end, device)
    if kv_end_BL.ndim == 1:
        kv_end_BL = kv_end_BL[None]
    pos_BL = None if position_ids is None else _as_kv_end(position_ids, kv_end_BL.device).reshape(kv_end_BL.shape)
    B, L = kv_end_BL.shape
    return create_block_mask(generate_tree_mask_mod(kv_end_BL, pos_BL, window), B, None, L, L,
                             device=kv_end_BL.device, BLOCK_SIZE=block_size)


# ---------------------------------------------------------------------------------------------
# the BlockMask of a block plan (onepass.attention.blocks): tiles from the plan, the mask_mod above for partial ones


def block_mask_from_plan(plan: BlockPlan, kv_end: Any, *, device: torch.device | str | None = None,
                         position_ids: Any = None, kv_end_BL: torch.Tensor | None = None,
                         position_ids_BL: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention ``BlockMask`` (shared by all heads) from ``plan``, on ``device``.

    ``kv_end`` (and, for a windowed plan, ``position_ids``) are the plan's own;
    they back the ``mask_mod`` that the kernel evaluates on partial tiles.
    ``device`` defaults to ``kv_end``'s device for a tensor, else CPU. ``kv_end_BL`` /
    ``position_ids_BL``: the same rows already on ``device`` (a batch's tensors), used for the
    ``mask_mod`` as they are; with numpy ``kv_end`` nothing is then read back from the device, and
    the tiles go there without waiting (:func:`onepass.batch.to_device`).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if device is None:
        device = (kv_end_BL.device if kv_end_BL is not None else
                  kv_end.device if isinstance(kv_end, torch.Tensor) else "cpu")
    checked_BL = as_kv_end_BL(kv_end)  # a tensor is read back here: pass numpy and kv_end_BL to avoid it
    if kv_end_BL is None and isinstance(kv_end, torch.Tensor):  # keep the caller's tensor for the mask_mod
        kv_end_BL = kv_end
    kv_end_BL = (to_device(checked_BL, device) if kv_end_BL is None
                 else kv_end_BL.to(device=device, dtype=torch.long).reshape(checked_BL.shape))
    if kv_end_BL.shape[1] != plan.length or kv_end_BL.shape[0] != plan.kind_BMN.shape[0]:
        raise ValueError(f"kv_end of shape {tuple(kv_end_BL.shape)} does not belong to a plan of "
                         f"{plan.kind_BMN.shape[0]} rows of {plan.length}")
    pos_BL = None
    if plan.window is not None:  # a tensor stays on its device; anything else goes through numpy
        if position_ids_BL is None and isinstance(position_ids, torch.Tensor):
            position_ids_BL = position_ids
        pos_BL = (position_ids_BL.to(device=device, dtype=torch.long).reshape(checked_BL.shape)
                  if position_ids_BL is not None
                  else to_device(as_positions_BL(position_ids, checked_BL.shape), device))
    num_BM, idx_BMN = ordered_blocks(plan.kind_BMN == PARTIAL)
    full_num_BM, full_idx_BMN = ordered_blocks(plan.kind_BMN == FULL)

    def put(x: np.ndarray) -> torch.Tensor:
        return to_device(x[:, None], device)  # [B, 1 head, ...]

    return BlockMask.from_kv_blocks(put(num_BM), put(idx_BMN), put(full_num_BM), put(full_idx_BMN),
                                    BLOCK_SIZE=plan.block_size,
                                    mask_mod=generate_tree_mask_mod(kv_end_BL, pos_BL, plan.window),
                                    seq_lengths=(plan.length, plan.length))


def block_mask(kv_end: Any, *, block_size: int = 128, device: torch.device | str | None = None,
               position_ids: Any = None, window: int | None = None, kv_end_BL: torch.Tensor | None = None,
               position_ids_BL: torch.Tensor | None = None) -> BlockMask:
    """The tree ``BlockMask`` for ``kv_end`` ([L] or [B, L]), built from :func:`block_plan`.

    Equals :func:`tree_block_mask` (``create_block_mask``) tile for tile,
    without evaluating the mask on L x L pairs (with a window: the same FULL tiles, no visible
    tile skipped; see the module docstring). Numpy ``kv_end`` (and ``position_ids``) with the
    batch's device tensors as ``kv_end_BL`` (``position_ids_BL``): built without a device read.
    """
    plan = block_plan(kv_end, block_size, position_ids=position_ids, window=window)
    return block_mask_from_plan(plan, kv_end, device=device, position_ids=position_ids, kv_end_BL=kv_end_BL,
                                position_ids_BL=position_ids_BL)
