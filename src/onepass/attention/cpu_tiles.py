"""Tree attention on CPU over a segment plan's tiles, computing only visible pairs: forward, backward, reference.

Why this module exists: dense SDPA with an L x L mask computes every masked
pair anyway, and FlexAttention has no backward on CPU. In a packed row most
pairs are masked (documents never see each other; a one-pass tree hides each
turn's reasoning from later turns). Here the row runs as the tiles of a
:class:`onepass.attention.segments.SegmentPlan`, each one call of PyTorch's fused CPU flash
attention kernel, forward and backward (:func:`tree_attention`, a torch function of
``q, k, v`` and the plan; :mod:`onepass.attention.cpu` hands it to transformers):

- diagonal tiles (a chunk of a segment against itself, causal): the whole
  chunks of a segment as one batched call on a strided view, the other chunks
  (short segments, last chunks) gathered into batches of similar width;
- rectangles, every pair visible, no mask at all: a chunk against the
  earlier chunks of its segment (a view of the row), and a whole segment against
  its ancestors (one gather of the ancestors' keys per segment, one call).

A query's tiles are combined with their log-sum-exps, the way ring or
flash-decoding attention combines key shards (the output moves towards the
rectangle's by its share of the softmax mass, ``sigmoid(lse_rect - lse_diag)``).
Grouped-query heads are the kernel's own where it takes them (key/value heads
are never repeated; :func:`native_gqa`); an older kernel gets them repeated once per row.
The backward pass runs the flash backward of each tile with the *combined*
output and log-sum-exp, which is exactly the gradient of one softmax over all
visible keys. Chunking matters on CPU: the kernel does not skip masked work
inside its 512-key blocks, so a causal square costs about a full one; chunks
of 128 queries keep the causal waste to the diagonal.

Worked example (the row of :mod:`onepass.attention.blocks`, chunk 2)::

    p       0 1 2 3 4 5 6 7      diagonals   [0,2) [2,4)  |  [4,6) [6,8)   a batched call per segment
    token   h h t t r r r r      rectangles  q [2,4) x k [0,2)             (its segment's earlier chunk)
    kv_end  8 8 4 4 8 8 8 8                  q [4,8) x k (0 1)             (ancestors h h, gathered)
                                             q [6,8) x k [4,6)

Sliding windows: the plan is cut for the window
(:func:`onepass.attention.segments.segment_plan`): chunks of at most W - 1 queries,
rectangles that start at the window and carry an additive mask where the
window cuts them; the work stays O(L * (W + chunk)). Attention sinks
(gpt-oss: one learned logit per head in every softmax) are one more term in
the log-sum-exp merge: ``out *= sigmoid(lse - sink)``, ``lse = logaddexp(lse,
sink)``; the tile backward with that output and lse is then exact, and the
sink's own gradient is ``-sum_q exp(sink - lse_q) * (dout_q . out_q)``.

The slow reference beside it is :func:`tree_attention_reference` (dense attention under
:func:`onepass.attention.mask.dense_mask`, every pair computed).

Legend: B rows, H query heads, J key/value heads, G chunks in a bucket, L row length,
T = B * L (rows flattened into one), D head dim, C chunk width, N chunks in a run,
K keys of a rectangle, n queries of a tile.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.attention.mask import dense_mask
from onepass.attention.segments import SegmentPlan, segment_plan
from onepass.private_names import private
from onepass.errors import ConfigError

FLASH = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = FLASH + "_backward"


@functools.cache
def flash_kernels() -> tuple[Any, Any]:
    """torch's private fused CPU flash attention ops, forward and backward, looked up when first used (never at
    import: a torch release that drops them fails in one line where ``onepass_cpu`` is chosen, not at import)."""
    return private(FLASH), private(FLASH_BACKWARD)


def _flash(*args: Any, **kwargs: Any) -> Any:
    return flash_kernels()[0](*args, **kwargs)


def _flash_backward(*args: Any, **kwargs: Any) -> Any:
    return flash_kernels()[1](*args, **kwargs)


class CpuAttentionError(ConfigError):
    """A call the CPU tree backend cannot serve exactly (it says what to use instead)."""


# ---------------------------------------------------------------------------------------------
# forward and backward over the plan's tiles (q: [1, H, T, D]; k, v: [1, J, T, D])


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _t_major(x_1HTD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [1, H, T, D] buffer laid out [1, T, H, D], like transformers' tensors and the kernel's gradients."""
    one, H, T, D = x_1HTD.shape
    return x_1HTD.new_empty((one, T, H, D), dtype=dtype).transpose(1, 2)


@functools.cache
def native_gqa() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads (forward and
    backward). Probed once, on first use, against stride-0 repeated heads; the one key/value head is a
    view of two, so a kernel that ignores the grouping reads the other and fails the check. Without
    it :func:`tree_attention` repeats keys and values once for the whole row."""
    gen = torch.Generator().manual_seed(0)
    q_1234, kv_1234 = torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, 4, generator=gen)
    kv_1134 = kv_1234[:, :1]
    try:
        out_1234, lse_123 = _flash(q_1234, kv_1134, kv_1134, 0.0, True)
        grads = _flash_backward(out_1234, q_1234, kv_1134, kv_1134, out_1234, lse_123, 0.0, True)
    except RuntimeError:
        return False
    want_1234 = _flash(q_1234, kv_1134.expand(1, 2, 3, 4), kv_1134.expand(1, 2, 3, 4), 0.0, True)[0]
    return tuple(grads[1].shape) == (1, 1, 3, 4) and torch.allclose(out_1234, want_1234)


def _runs(x_1HTD: torch.Tensor, start: int, num: int, width: int) -> torch.Tensor:
    """``num`` consecutive chunks of ``width`` from ``start`` as a batch: a ``[num, H, width, ...]`` view."""
    return x_1HTD[0, :, start:start + num * width].unflatten(1, (num, width)).transpose(0, 1)


def _grouped(x_1HTD: torch.Tensor, idx_GC: torch.Tensor) -> torch.Tensor:
    """Positions ``idx_GC`` stacked as a batch: ``[1, H, T, D] -> [G, H, C, D]`` (a gather)."""
    G, C = idx_GC.shape
    return x_1HTD.index_select(2, idx_GC.reshape(-1)).reshape(x_1HTD.shape[1], G, C, -1).transpose(0, 1)


def _buckets(plan: SegmentPlan):
    """Per bucket: gather index (padding points at its chunk's start), pad rows (None if none), and
    the real slots of the flattened bucket with their row positions (None: every slot, in order)."""
    for idx_GC in plan.diag_buckets:
        valid_GC = idx_GC >= 0
        if valid_GC.all():
            gather_GC = torch.from_numpy(idx_GC)
            yield gather_GC, None, None, gather_GC.reshape(-1)
            continue
        slots = np.flatnonzero(valid_GC.reshape(-1))
        yield (torch.from_numpy(np.where(valid_GC, idx_GC, idx_GC[:, :1])),
               torch.from_numpy(~valid_GC)[:, None, :, None], torch.from_numpy(slots),
               torch.from_numpy(idx_GC.reshape(-1)[slots]))


def _real(x_GHC: torch.Tensor, slots: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The real (unpadded) slots of a bucket's result, as ``[1, H, n, ...]``."""
    x_1HN = x_GHC.transpose(0, 1).reshape(1, x_GHC.shape[1], -1, *x_GHC.shape[3:])
    return (x_1HN if slots is None else x_1HN.index_select(2, slots)).to(dtype)


def _rect_keys(plan: SegmentPlan, r: int) -> tuple[int, int] | torch.Tensor:
    """Row positions of rectangle r's keys: ``(start, stop)`` when they are one range of the row (a view:
    a chunk's own earlier positions, or ancestors laid out heaviest child first), else an index tensor."""
    i, _, _, hi = plan.rect_R4[r].tolist()
    keys = plan.keys(i)[int(plan.rect_lo_R[r]):hi]  # ascending
    if keys[-1] - keys[0] == len(keys) - 1:
        return int(keys[0]), int(keys[-1]) + 1
    return torch.from_numpy(keys)


def _take(x_1JTD: torch.Tensor, keys: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    return x_1JTD[:, :, keys[0]:keys[1]] if isinstance(keys, tuple) else x_1JTD.index_select(2, keys)


@dataclass(frozen=True)
class _Tiles:
    """A plan's tiles as the loops take them. Every layer, forward and backward, walks the same plan:
    its numpy arrays become ints and index tensors once per batch (:func:`_tiles_of`), not per layer."""

    runs: list[tuple[int, int, int]]  # (start, n, width) of each batched diagonal run
    buckets: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]]  # _buckets
    rects: list[tuple[int, int, tuple[int, int] | torch.Tensor]]  # (q0, q1, keys: _rect_keys)


def _build_tiles(plan: SegmentPlan) -> _Tiles:
    bounds = enumerate(plan.rect_R4[:, 1:3].tolist())
    return _Tiles(runs=[tuple(run) for run in plan.diag_runs_R3.tolist()], buckets=list(_buckets(plan)),
                  rects=[(q0, q1, _rect_keys(plan, r)) for r, (q0, q1) in bounds])


_TILES: OrderedDict[int, tuple[SegmentPlan, _Tiles]] = OrderedDict()  # id(plan) -> (plan, tiles), newest last


def _tiles_of(plan: SegmentPlan, keep: int = 8) -> _Tiles:
    """``plan``'s tiles, built once; the last ``keep`` plans are held, so a cached id is never reused."""
    plan_tiles = _TILES.pop(id(plan), None)
    if plan_tiles is None or plan_tiles[0] is not plan:
        plan_tiles = (plan, _build_tiles(plan))
    _TILES[id(plan)] = plan_tiles
    while len(_TILES) > keep:
        _TILES.popitem(last=False)
    return plan_tiles[1]


def _rect_masks(plan: SegmentPlan, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Per rectangle: the additive ``[n, keys]`` mask of its window cut, or None (every pair visible)."""
    out: list[torch.Tensor | None] = []
    for r in range(len(plan.rect_R4)):
        visible = plan.rect_visible(r)
        out.append(None if visible is None else
                   torch.zeros(visible.shape, dtype=dtype).masked_fill_(torch.from_numpy(~visible), -torch.inf))
    return out


def _forward(q_1HTD, k_1JTD, v_1JTD, sinks_H, plan: SegmentPlan, masks, scale: float | None):
    acc = _accumulator(q_1HTD.dtype)
    tiles = _tiles_of(plan)
    out_1HTD = _t_major(q_1HTD, acc)  # transformers' output layout: its final transpose is free
    lse_1HT1 = q_1HTD.new_empty((*q_1HTD.shape[:3], 1), dtype=acc)
    # every position is on one diagonal: plain writes
    for run in tiles.runs:
        o_NHCD, lse_NHC = _flash(_runs(q_1HTD, *run), _runs(k_1JTD, *run), _runs(v_1JTD, *run), 0.0, True,
                                 scale=scale)
        _runs(out_1HTD, *run).copy_(o_NHCD)
        _runs(lse_1HT1, *run).copy_(lse_NHC[..., None])
    for gather_GC, _, slots, positions in tiles.buckets:
        o_GHCD, lse_GHC = _flash(_grouped(q_1HTD, gather_GC), _grouped(k_1JTD, gather_GC),
                                 _grouped(v_1JTD, gather_GC), 0.0, True, scale=scale)
        out_1HTD.index_copy_(2, positions, _real(o_GHCD, slots, acc))
        lse_1HT1.index_copy_(2, positions, _real(lse_GHC[..., None], slots, acc))
    # rectangles merge into their diagonals by their log-sum-exps
    for r, (q0, q1, keys) in enumerate(tiles.rects):
        o_1HnD, lse_1Hn = _flash(q_1HTD[:, :, q0:q1], _take(k_1JTD, keys), _take(v_1JTD, keys), 0.0, False,
                                 attn_mask=masks[r], scale=scale)
        old_lse_1Hn1 = lse_1HT1[:, :, q0:q1]
        lse_1Hn1 = lse_1Hn[..., None].to(acc)
        out_1HTD[:, :, q0:q1].lerp_(o_1HnD.to(acc), torch.sigmoid(lse_1Hn1 - old_lse_1Hn1))
        torch.logaddexp(old_lse_1Hn1, lse_1Hn1, out=old_lse_1Hn1)
    if sinks_H is not None:  # one more logit per head in every softmax
        sink_1H11 = sinks_H.to(acc)[None, :, None, None]
        out_1HTD.mul_(torch.sigmoid(lse_1HT1 - sink_1H11))
        torch.logaddexp(lse_1HT1, sink_1H11, out=lse_1HT1)
    return out_1HTD.to(q_1HTD.dtype), lse_1HT1[..., 0]


def _backward(g_1HTD, q_1HTD, k_1JTD, v_1JTD, out_1HTD, lse_1HT, plan: SegmentPlan, masks, scale: float | None):
    acc = _accumulator(q_1HTD.dtype)
    tiles = _tiles_of(plan)
    dq_1HTD, dk_1JTD, dv_1JTD = (_t_major(x, acc) for x in (q_1HTD, k_1JTD, v_1JTD))
    lse_1HT1 = lse_1HT[..., None]
    for run in tiles.runs:  # diagonals tile the row: first writes
        dq, dk, dv = _flash_backward(_runs(g_1HTD, *run), _runs(q_1HTD, *run), _runs(k_1JTD, *run),
                                     _runs(v_1JTD, *run), _runs(out_1HTD, *run), _runs(lse_1HT1, *run)[..., 0],
                                     0.0, True, scale=scale)
        _runs(dq_1HTD, *run).copy_(dq)
        _runs(dk_1JTD, *run).copy_(dk)
        _runs(dv_1JTD, *run).copy_(dv)
    for gather_GC, pad_G1C1, slots, positions in tiles.buckets:
        g_GHCD, lse_GHC1 = _grouped(g_1HTD, gather_GC), _grouped(lse_1HT1, gather_GC)
        if pad_G1C1 is not None:  # padding rows: no gradient in, lse = +inf so their softmax weights are 0
            g_GHCD, lse_GHC1 = g_GHCD.masked_fill(pad_G1C1, 0), lse_GHC1.masked_fill(pad_G1C1, float("inf"))
        dq, dk, dv = _flash_backward(g_GHCD, _grouped(q_1HTD, gather_GC), _grouped(k_1JTD, gather_GC),
                                     _grouped(v_1JTD, gather_GC), _grouped(out_1HTD, gather_GC),
                                     lse_GHC1[..., 0], 0.0, True, scale=scale)
        dq_1HTD.index_copy_(2, positions, _real(dq, slots, acc))
        dk_1JTD.index_copy_(2, positions, _real(dk, slots, acc))
        dv_1JTD.index_copy_(2, positions, _real(dv, slots, acc))
    for r, (q0, q1, keys) in enumerate(tiles.rects):  # rectangles add
        dq_1HnD, dk_1JKD, dv_1JKD = _flash_backward(
            g_1HTD[:, :, q0:q1], q_1HTD[:, :, q0:q1], _take(k_1JTD, keys), _take(v_1JTD, keys),
            out_1HTD[:, :, q0:q1], lse_1HT[:, :, q0:q1], 0.0, False, attn_mask=masks[r], scale=scale)
        dq_1HTD[:, :, q0:q1] += dq_1HnD
        if isinstance(keys, tuple):
            dk_1JTD[:, :, keys[0]:keys[1]] += dk_1JKD
            dv_1JTD[:, :, keys[0]:keys[1]] += dv_1JKD
        else:
            dk_1JTD.index_add_(2, keys, dk_1JKD.to(acc))
            dv_1JTD.index_add_(2, keys, dv_1JKD.to(acc))
    return dq_1HTD, dk_1JTD, dv_1JTD


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_1HTD, k_1JTD, v_1JTD, sinks_H, plan, scale):
        masks = _rect_masks(plan, q_1HTD.dtype)
        out_1HTD, lse_1HT = _forward(q_1HTD, k_1JTD, v_1JTD, sinks_H, plan, masks, scale)
        ctx.save_for_backward(q_1HTD, k_1JTD, v_1JTD, out_1HTD, lse_1HT, sinks_H)
        ctx.plan, ctx.masks, ctx.scale = plan, masks, scale
        return out_1HTD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_1HTD):
        q_1HTD, k_1JTD, v_1JTD, out_1HTD, lse_1HT, sinks_H = ctx.saved_tensors
        grads = _backward(g_1HTD, q_1HTD, k_1JTD, v_1JTD, out_1HTD, lse_1HT, ctx.plan, ctx.masks, ctx.scale)
        dsinks_H = None
        if sinks_H is not None and ctx.needs_input_grad[3]:  # d sink = -sum_q p_sink(q) * (dout_q . out_q)
            acc = _accumulator(q_1HTD.dtype)
            p_sink_1HT = torch.exp(sinks_H.to(acc)[None, :, None] - lse_1HT)
            dot_1HT = (g_1HTD.to(acc) * out_1HTD.to(acc)).sum(-1)
            dsinks_H = -(p_sink_1HT * dot_1HT).sum((0, 2)).to(sinks_H.dtype)
        return (*(g.to(x.dtype) for g, x in zip(grads, (q_1HTD, k_1JTD, v_1JTD))), dsinks_H, None, None)


def tree_attention(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                   plan: SegmentPlan | Any, *, scale: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention under the tree mask of ``plan`` (or of a ``kv_end`` ``[L]``/``[B, L]``), visible pairs only.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention, in
    transformers' head order); ``sinks`` (``[H]``) adds one logit per head to every
    softmax. Returns ``[B, H, L, D]``; differentiable in q, k, v and sinks.
    """
    if not isinstance(plan, SegmentPlan):
        plan = segment_plan(plan)
    B, H, L, _ = q_BHLD.shape
    if (plan.num_rows, plan.row_length) != (B, L) or k_BHLD.shape[2] != L:
        raise CpuAttentionError(f"a plan for {plan.num_rows} rows of {plan.row_length} cannot serve queries "
                                f"{tuple(q_BHLD.shape)} and keys {tuple(k_BHLD.shape)} (no KV cache here)")
    if q_BHLD.device.type != "cpu":
        raise CpuAttentionError(f"onepass_cpu runs on CPU, got tensors on {q_BHLD.device}; on CUDA use "
                                "flex_attention with onepass.attention.mask.block_mask")
    J = k_BHLD.shape[1]
    if H % J:
        raise CpuAttentionError(f"{H} query heads cannot share {J} key/value heads")

    def flat(x_BHLD: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [1, H, T, D]; a view when B == 1
        return x_BHLD.transpose(0, 1).reshape(1, x_BHLD.shape[1], B * L, x_BHLD.shape[-1])

    if sinks is not None and tuple(sinks.shape) != (H,):
        raise CpuAttentionError(f"attention sinks must be one per query head ({H}), got {tuple(sinks.shape)}")
    if J != H and not native_gqa():  # older torch: key/value heads repeated once for the row
        k_BHLD, v_BHLD = k_BHLD.repeat_interleave(H // J, 1), v_BHLD.repeat_interleave(H // J, 1)
    out_1HTD = _TreeAttention.apply(flat(q_BHLD), flat(k_BHLD), flat(v_BHLD), sinks, plan, scale)
    return out_1HTD.reshape(H, B, L, -1).transpose(0, 1)


def tree_attention_reference(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                             kv_end_BL: Any, *, scale: float | None = None, position_ids: Any = None,
                             window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Slow reference: dense attention under ``onepass.attention.mask.dense_mask`` (every pair computed)."""
    kv_end_BL = torch.as_tensor(np.asarray(kv_end_BL))
    kv_end_BL = kv_end_BL.reshape(-1, kv_end_BL.shape[-1])
    pos = None if position_ids is None else np.asarray(position_ids).reshape(kv_end_BL.shape)
    mask_B1LL = dense_mask(kv_end_BL, device=q_BHLD.device, position_ids=pos, window=window)[:, None]
    return dense_attention(q_BHLD, k_BHLD, v_BHLD, mask_B1LL, scale=scale, sinks=sinks)


def dense_attention(q_BHQD: torch.Tensor, k_BJKD: torch.Tensor, v_BJKD: torch.Tensor, mask: torch.Tensor | None, *,
                    scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every pair: ``softmax([q.k * scale + mask, sink]) @ v`` without the sink's column (gpt-oss's eager
    math, in the input's dtype); plain SDPA without sinks. ``mask``: bool (True = attend), additive
    float, or None (causal). Returns ``[B, H, Q, D]``."""
    G = q_BHQD.shape[1] // k_BJKD.shape[1]
    if sinks is None:
        causal = mask is None
        return torch.nn.functional.scaled_dot_product_attention(q_BHQD, k_BJKD, v_BJKD, attn_mask=mask,
                                                                is_causal=causal, scale=scale, enable_gqa=G > 1)
    k_BHKD, v_BHKD = k_BJKD.repeat_interleave(G, 1), v_BJKD.repeat_interleave(G, 1)
    scores_BHQK = q_BHQD @ k_BHKD.transpose(-1, -2) * (q_BHQD.shape[-1] ** -0.5 if scale is None else scale)
    Q, K = scores_BHQK.shape[-2:]
    if mask is None:
        mask = torch.ones(Q, K, dtype=torch.bool, device=q_BHQD.device).tril(K - Q)
    scores_BHQK = (scores_BHQK.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool
                   else scores_BHQK + mask[..., :K])
    sink_BHQ1 = sinks.to(scores_BHQK.dtype).reshape(1, -1, 1, 1).expand(*scores_BHQK.shape[:3], 1)
    probs_BHQK = torch.softmax(torch.cat([scores_BHQK, sink_BHQ1], dim=-1), dim=-1)[..., :K]
    return probs_BHQK.to(v_BHKD.dtype) @ v_BHKD
