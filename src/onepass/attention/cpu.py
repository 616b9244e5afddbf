"""``onepass_cpu``: tree attention on CPU as a transformers attention backend.

Why this module exists: a HF model calls its attention function with the mask
transformers hands each layer; this module is that glue, kept apart from the tile
kernels (:mod:`onepass.attention.cpu_tiles`, :func:`~onepass.attention.cpu_tiles.tree_attention`).
It owns the mask object, which carries the row's segment plan so the plan is built
once per batch and shared by every layer, and the rule for which mask runs where.

Use with a HF model: ``register()`` once, load the model with
``attn_implementation="onepass_cpu"``, and pass ``attention_mask=
cpu_attention_mask(kv_end_BL)``: an int64 ``[B, 1, 1, L]`` tensor (kv_end
itself; 4-D, so transformers hands it to every layer untouched) with its plan
attached, so the plan is built once per batch. Any other mask (None, 2-D
padding, 4-D bool/float) runs transformers' own ``sdpa`` (or
:func:`~onepass.attention.cpu_tiles.dense_attention` for a layer with attention sinks).

Legend: B rows, H query heads, L row length, D head dim, Q queries.
"""

from __future__ import annotations

from typing import Any

import torch

from onepass.attention.cpu_tiles import CpuAttentionError, dense_attention, flash_kernels, tree_attention
from onepass.attention.segments import SegmentPlan, segment_plan

BACKEND = "onepass_cpu"
_PLAN_ATTR = "onepass_segment_plan"


# ---------------------------------------------------------------------------------------------
# the mask object and the plan cache


def cpu_attention_mask(kv_end_BL: Any, *, chunk: int = 128, position_ids: Any = None,
                       window: int | None = None) -> torch.Tensor:
    """The ``attention_mask`` a model with the ``onepass_cpu`` backend takes for rows ``kv_end_BL``.

    An int64 ``[B, 1, 1, L]`` copy of ``kv_end`` with its segment plan attached
    (cut for a sliding ``window`` over ``position_ids`` when given).
    """
    given = kv_end_BL  # numpy (a batch's host rows) is planned as it is: no tensor read back
    kv_end_BL = torch.as_tensor(kv_end_BL)
    if kv_end_BL.ndim == 1:
        kv_end_BL = kv_end_BL[None]
    if kv_end_BL.ndim != 2:
        raise ValueError(f"kv_end_BL must be [B, L], got shape {tuple(kv_end_BL.shape)}")
    B, L = kv_end_BL.shape
    mask_B11L = kv_end_BL.to(torch.long).reshape(B, 1, 1, L).clone()
    setattr(mask_B11L, _PLAN_ATTR, segment_plan(given, chunk=chunk, position_ids=position_ids, window=window))
    return mask_B11L


def is_kv_end_mask(attention_mask: Any) -> bool:
    """True for the object :func:`cpu_attention_mask` returns (an int64 ``[B, 1, 1, L]`` tensor)."""
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.long
            and attention_mask.ndim == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1)


def plan_of(mask_B11L: torch.Tensor) -> SegmentPlan:
    """The plan attached to ``mask_B11L``, built and attached on first use (once per batch)."""
    plan = getattr(mask_B11L, _PLAN_ATTR, None)
    if plan is None:
        plan = segment_plan(mask_B11L[:, 0, 0])
        setattr(mask_B11L, _PLAN_ATTR, plan)
    return plan


# ---------------------------------------------------------------------------------------------
# the transformers backend


def onepass_cpu_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention function (``AttentionInterface``): [B, H, L, D] in, [B, L, H, D] out.

    With a :func:`cpu_attention_mask` it runs :func:`tree_attention`; with any
    other mask it is transformers' ``sdpa`` (:func:`dense_attention` when the
    layer has attention sinks, which sdpa ignores). Refuses what it cannot do
    exactly, and a mask cut for another window than the layer's.
    """
    sinks = kwargs.pop("s_aux", None)
    layer = getattr(module, "layer_idx", "?")
    unsupported = {"dropout": dropout or None, "softcap": softcap, "position_bias": kwargs.get("position_bias")}
    if not is_kv_end_mask(attention_mask) and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    for name, given in unsupported.items():
        if given is not None:
            raise CpuAttentionError(f"onepass_cpu does not implement {name}={given!r} (layer {layer}); use "
                                    "attn_implementation='eager' with onepass.attention.backends's dense mask, "
                                    "or turn it off")
    if not is_kv_end_mask(attention_mask):  # a mask transformers built (N-pass views), with sinks
        out_BHQD = dense_attention(query, key, value, attention_mask, scale=scaling, sinks=sinks)
        return out_BHQD.transpose(1, 2).contiguous(), None
    plan = plan_of(attention_mask)
    if (sliding_window or None) != plan.window:
        raise CpuAttentionError(f"layer {layer} has sliding_window={sliding_window} but its onepass_cpu mask was "
                                f"built for window={plan.window}; build the masks with "
                                "onepass.attention.attention_mask_for(model, kv_end, position_ids_BL=...)")
    if key.dtype != query.dtype or value.dtype != query.dtype:  # CPU autocast hands over mixed dtypes
        key, value = key.to(query.dtype), value.to(query.dtype)
    dim_qk, dim_v = query.shape[-1], value.shape[-1]
    if dim_qk != dim_v:  # multi-head latent attention: zero-pad to one head size (the kernel needs it)
        scaling = dim_qk ** -0.5 if scaling is None else scaling
        dim = max(dim_qk, dim_v)
        pad = torch.nn.functional.pad
        query, key, value = pad(query, (0, dim - dim_qk)), pad(key, (0, dim - dim_qk)), pad(value, (0, dim - dim_v))
    out_BHLD = tree_attention(query, key, value, plan, scale=scaling, sinks=sinks)[..., :dim_v]
    return out_BHLD.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``attn_implementation="onepass_cpu"`` available to transformers (idempotent). Returns the name.
    A torch without the CPU flash kernels it runs on is one :class:`~onepass.model.couplings.CouplingError`
    line here."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    flash_kernels()
    AttentionInterface.register(BACKEND, onepass_cpu_attention)
    # masks transformers builds itself (None / 2-D padding) are the sdpa ones; ours is 4-D and passes through
    AttentionMaskInterface.register(BACKEND, sdpa_mask)
    return BACKEND
