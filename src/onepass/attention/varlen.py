"""``onepass_varlen``: tree rows through torch's own flash varlen kernel, the FA2-class kernel.

Why this module exists: the paper compares one-pass against N-pass packed with FlashAttention-2's
variable-length kernel, and torch ships that kernel (``torch.nn.attention.varlen.varlen_attn``,
FlashAttention-2's varlen forward and backward, CUDA only), so no ``flash_attn`` wheel is needed. It
serves both sides of that comparison exactly: N-pass packed rows (documents side by side, each causal:
the baseline) and one-pass trees, through one gather (:mod:`onepass.attention.gather`): each segment's
queries against its gathered root path, causal at the bottom right, one kernel call per layer. This
module is the glue as a transformers attention backend, and the CPU kernel that runs the same plan.

On CPU the plan runs on :func:`varlen_attention_reference` (SDPA per segment with the bottom-right
causal mask spelled out), so ``onepass verify --attn onepass_varlen`` checks the gather plan in float64
on CPU, and the GPU check compares the real kernel against the same reference.

What it cannot do exactly is refused in one line: attention sinks (gpt-oss: the kernel gives no gradient
through its log-sum-exp, which a sink renormalises; flex_attention on CUDA and onepass_cpu on CPU carry
them), logit soft-capping and dropout.

The mask object: an int64 ``[B, 1, 1, L]`` copy of ``kv_end`` (4-D, so transformers hands it to every
layer untouched, like ``onepass_cpu``'s) with the gather plan and its index tensors attached, built once
per batch from host-side rows (no device sync inside the step).

Legend: B rows, L row length, H query heads, J key/value heads, D head dim, T = B * L tokens,
K gathered keys.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.attention.gather import GatherPlan, gather_plan
from onepass.errors import ConfigError

BACKEND = "onepass_varlen"
_PLAN_ATTR = "onepass_varlen_plan"


class VarlenError(ConfigError):
    """A row or a layer the varlen kernel cannot serve exactly."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """A :class:`~onepass.attention.gather.GatherPlan` with its index tensors on the rows' device."""

    plan: GatherPlan
    cu_seqlens_q: torch.Tensor  # int32 [S + 1]
    cu_seqlens_k: torch.Tensor  # int32 [S + 1]
    key_index: torch.Tensor | None  # int64 [K]; None: no gather


def _host(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def varlen_attention_mask(kv_end_BL: Any, *, position_ids: Any = None, window: int | None = None,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """The ``attention_mask`` a model with the ``onepass_varlen`` backend takes for rows ``kv_end_BL``
    (cut for a sliding ``window`` over ``position_ids`` when given), on ``device`` (default: where
    ``kv_end_BL`` is). Give host-side rows (numpy or CPU tensors): the plan is numpy."""
    kv_end = _host(kv_end_BL).astype(np.int64)
    kv_end = kv_end.reshape(-1, kv_end.shape[-1])
    if device is None:
        device = kv_end_BL.device if isinstance(kv_end_BL, torch.Tensor) else "cpu"
    plan = gather_plan(kv_end, position_ids=_host(position_ids), window=window)
    B, L = kv_end.shape
    mask_B11L = torch.as_tensor(kv_end, device=device).reshape(B, 1, 1, L)

    def to_device(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(device, non_blocking=True)

    setattr(mask_B11L, _PLAN_ATTR, DevicePlan(plan, to_device(plan.cu_seqlens_q), to_device(plan.cu_seqlens_k),
                                              None if plan.key_index is None else to_device(plan.key_index)))
    return mask_B11L


def plan_of(attention_mask: Any) -> DevicePlan | None:
    """The plan :func:`varlen_attention_mask` attached to ``attention_mask``, or None."""
    return getattr(attention_mask, _PLAN_ATTR, None)


@functools.cache
def _gqa_kwargs() -> dict[str, Any]:
    """torch >= 2.13's ``varlen_attn`` runs grouped-query heads only when asked (``enable_gqa``); 2.11's runs
    them without the keyword (the flash kernel's own grouping)."""
    from torch.nn.attention.varlen import varlen_attn

    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


def varlen_attention(q_THD: torch.Tensor, k_TJD: torch.Tensor, v_TJD: torch.Tensor, plan: DevicePlan, *,
                     scale: float | None = None) -> torch.Tensor:
    """Tree attention over flattened rows: keys and values gathered by ``plan``, then one varlen call,
    causal at the bottom right (``window_size=(-1, 0)``, or ``(W - 1, 0)`` for a window of W positions).
    torch's flash kernel on CUDA, :func:`varlen_attention_reference` elsewhere. Returns ``[T, H, D]``."""
    if plan.key_index is not None:  # autograd's backward of a gather is the index-add
        k_TJD, v_TJD = k_TJD.index_select(0, plan.key_index), v_TJD.index_select(0, plan.key_index)
    window = plan.plan.window
    if q_THD.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        gqa = _gqa_kwargs() if q_THD.shape[1] != k_TJD.shape[1] else {}
        return varlen_attn(q_THD, k_TJD, v_TJD, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.plan.max_q,
                           plan.plan.max_k, scale=scale, window_size=(-1 if window is None else window - 1, 0),
                           **gqa)
    return varlen_attention_reference(q_THD, k_TJD, v_TJD, plan.plan.cu_seqlens_q, plan.plan.cu_seqlens_k,
                                      scale=scale, window=window)


def bottom_right_mask(num_queries: int, num_keys: int, window: int | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[n, m]``: query j sees key i iff ``i <= j + m - n`` (and ``i > j + m - n - window``): causal
    aligned at the bottom right, FlashAttention-2's rule when queries are shorter than keys.

    >>> bottom_right_mask(2, 4).int().tolist()
    [[1, 1, 1, 0], [1, 1, 1, 1]]
    """
    cu_q, cu_k = torch.tensor([0, num_queries]), torch.tensor([0, num_keys])
    return _visible(cu_q, cu_k, 0, num_queries, 0, num_keys, window).to(device)


def _visible(cu_q: torch.Tensor, cu_k: torch.Tensor, q0: int, q1: int, k0: int, k1: int,
             window: int | None) -> torch.Tensor:
    """Bool ``[q1 - q0, k1 - k0]`` over whole segments: query q of segment i sees the gathered keys from
    ``cu_k[i]`` (or its window's start) to ``cu_k[i + 1] - (cu_q[i + 1] - q)``, its own (bottom right)."""
    q = torch.arange(q0, q1)
    seg = torch.searchsorted(cu_q, q, right=True) - 1
    last = cu_k[seg + 1] - (cu_q[seg + 1] - q)
    first = cu_k[seg] if window is None else torch.maximum(cu_k[seg], last - (window - 1))
    k = torch.arange(k0, k1)[None, :]
    return (k >= first[:, None]) & (k <= last[:, None])


def varlen_attention_reference(q_THD: torch.Tensor, k_KJD: torch.Tensor, v_KJD: torch.Tensor,
                               cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, *, scale: float | None = None,
                               window: int | None = None, pairs: int = 1 << 20) -> torch.Tensor:
    """The varlen kernel's contract, computed plainly: segment i's queries ``q[cu_q[i]:cu_q[i + 1]]`` against
    its keys ``k[cu_k[i]:cu_k[i + 1]]`` under :func:`bottom_right_mask`, by SDPA with the mask spelled out
    (grouped-query heads by its ``enable_gqa``); runs of consecutive segments share one call while their
    queries x keys stay under ``pairs``. Any device and dtype (float64 for exactness)."""
    cu_q, cu_k = torch.as_tensor(np.asarray(cu_seqlens_q), dtype=torch.long), torch.as_tensor(
        np.asarray(cu_seqlens_k), dtype=torch.long)
    gqa = q_THD.shape[1] != k_KJD.shape[1]
    pieces, i, S = [], 0, len(cu_q) - 1
    while i < S:
        j = i + 1  # segments i .. j - 1 in one call
        while j < S and (cu_q[j + 1] - cu_q[i]) * (cu_k[j + 1] - cu_k[i]) <= pairs:
            j += 1
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[j]), int(cu_k[i]), int(cu_k[j])
        mask = _visible(cu_q, cu_k, q0, q1, k0, k1, window).to(q_THD.device)
        q_1HnD, k_1JmD, v_1JmD = (x.transpose(0, 1)[None] for x in (q_THD[q0:q1], k_KJD[k0:k1], v_KJD[k0:k1]))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(
            q_1HnD, k_1JmD, v_1JmD, attn_mask=mask, scale=scale, enable_gqa=gqa)[0].transpose(0, 1))
        i = j
    return torch.cat(pieces) if pieces else q_THD.new_empty(q_THD.shape[:2] + v_KJD.shape[-1:])


def _is_kv_end(attention_mask: Any) -> bool:
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.long
            and attention_mask.ndim == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1)


def onepass_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention function (``AttentionInterface``): [B, H, L, D] in, [B, L, H, D] out.

    With a :func:`varlen_attention_mask` (cut for the layer's own window) it runs the gather plan;
    grouped-query attention runs as the kernel runs it (J key/value heads shared by H / J query heads
    each, not repeated). With any other mask (None, transformers' own causal or padding mask: a plain
    forward, as verify's N-pass reference makes) it is transformers' ``sdpa``."""
    layer = getattr(module, "layer_idx", "?")
    if kwargs.get("s_aux") is not None or isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise VarlenError(f"{BACKEND} cannot train attention sinks (layer {layer}): torch's varlen kernel gives no "
                          "gradient through its log-sum-exp, which a sink renormalises; use flex_attention on CUDA "
                          "or onepass_cpu on CPU")
    plan = plan_of(attention_mask)
    if plan is None and _is_kv_end(attention_mask):  # a model that sliced our mask: kv_end without its plan
        if sliding_window:
            raise VarlenError(f"{BACKEND} (layer {layer}) needs the mask of onepass.attention.varlen."
                              "varlen_attention_mask cut for its window (onepass.attention.attention_mask_for builds "
                              "it), not kv_end alone: a window needs the rows' position ids")
        plan = plan_of(varlen_attention_mask(attention_mask[:, 0, 0], device=attention_mask.device))
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    for name, given in {"dropout": dropout or None, "softcap": softcap}.items():
        if given is not None:
            raise VarlenError(f"{BACKEND} does not implement {name}={given!r} (layer {layer}); use flex_attention "
                              "on CUDA or eager")
    if (sliding_window or None) != plan.plan.window:
        raise VarlenError(f"layer {layer} has sliding_window={sliding_window} but its {BACKEND} mask was built for "
                          f"window={plan.plan.window}; build the masks with onepass.attention.attention_mask_for("
                          "model, kv_end, position_ids_BL=...)")
    B, H, L, D = query.shape
    if (plan.plan.num_rows, plan.plan.row_length) != (B, L) or key.shape[2] != L:
        raise VarlenError(f"{BACKEND} (layer {layer}): a mask for {plan.plan.num_rows} rows of "
                          f"{plan.plan.row_length} cannot serve queries {tuple(query.shape)} and keys "
                          f"{tuple(key.shape)} (no KV cache here)")
    if key.dtype != query.dtype or value.dtype != query.dtype:  # autocast hands over mixed dtypes
        key, value = key.to(query.dtype), value.to(query.dtype)
    dim_v = value.shape[-1]
    if D != dim_v:  # multi-head latent attention: zero-pad to one head size (the kernel needs it)
        scaling = D ** -0.5 if scaling is None else scaling
        dim, pad = max(D, dim_v), torch.nn.functional.pad
        query, key, value = pad(query, (0, dim - D)), pad(key, (0, dim - D)), pad(value, (0, dim - dim_v))
    q_THD, k_TJD, v_TJD = (t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[-1]) for t in (query, key, value))
    out_THD = varlen_attention(q_THD, k_TJD, v_TJD, plan, scale=scaling)
    return out_THD[..., :dim_v].reshape(B, L, H, dim_v), None


def register() -> str:
    """Make ``attn_implementation="onepass_varlen"`` available to transformers (idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BACKEND, onepass_varlen_attention)
    AttentionMaskInterface.register(BACKEND, sdpa_mask)  # ours is 4-D and passes through untouched
    return BACKEND
