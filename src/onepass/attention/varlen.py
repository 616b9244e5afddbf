"""``onepass_varlen``: N-pass packed rows through torch's own flash kernel, the FA2-class baseline.

Why this module exists: the paper compares one-pass against N-pass packed with FlashAttention-2's
variable-length kernel (documents side by side in one row, each attending causally to itself),
and a comparison against N-pass with FlexAttention alone would leave out the fastest N-pass there
is. torch ships that kernel (``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2's varlen
forward and backward, CUDA only), so no ``flash_attn`` wheel is needed. This module is its glue
as a transformers attention backend, used by ``onepass bench --backends onepass_varlen`` on CUDA.

It serves rows whose tree never branches (:func:`onepass.layout.geometry.branches` is False): N-pass
rows, packed or not, and padding. There each segment (:func:`onepass.layout.geometry.segment_starts`) is
one document and the tree mask ``k <= q < kv_end[k]`` is causal attention inside it, which is what
the kernel computes from the documents' cumulative lengths. A row that branches (one-pass trees)
is refused in one line: a varlen kernel cannot express a tree.

The mask object: an int64 ``[B, 1, 1, L]`` copy of ``kv_end`` (4-D, so transformers hands it to
every layer untouched, like ``onepass_cpu``'s) with the documents attached, cut once per batch.

Legend: B rows, L row length, H query heads, K key/value heads, D head dim, T = B * L tokens.

    >>> documents([[3, 3, 3, 5, 5, 6]]).cu_seqlens.tolist(), documents([[3, 3, 3, 5, 5, 6]]).max_len
    ([0, 3, 5, 6], 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.errors import ConfigError
from onepass.layout.geometry import branches, check_tree, segment_starts

BACKEND = "onepass_varlen"
_DOCS_ATTR = "onepass_varlen_documents"


class VarlenError(ConfigError):
    """A row or a layer the varlen kernel cannot serve exactly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Documents:
    """The documents of ``[B, L]`` rows laid end to end: ``cu_seqlens[i]:cu_seqlens[i + 1]`` is one."""

    cu_seqlens: np.ndarray  # int32 [N + 1], 0 first, B * L last
    max_len: int


def documents(kv_end_BL: Any) -> Documents:
    """The documents of rows that never branch (N-pass rows and padding); a row that branches is refused."""
    kv_end = np.asarray(kv_end_BL.cpu() if isinstance(kv_end_BL, torch.Tensor) else kv_end_BL, dtype=np.int64)
    if kv_end.ndim == 1:
        kv_end = kv_end[None]
    check_tree(kv_end)
    for b, row in enumerate(kv_end):
        if branches(row):
            raise VarlenError(f"{BACKEND}: row {b} is a tree that branches (a one-pass row); a varlen kernel "
                              "serves N-pass rows only: use flex_attention for one-pass rows")
    starts = np.flatnonzero(segment_starts(kv_end).reshape(-1))
    cu = np.append(starts, kv_end.size).astype(np.int32)
    return Documents(cu_seqlens=cu, max_len=int(np.diff(cu).max()) if len(cu) > 1 else 0)


def varlen_attention_mask(kv_end_BL: torch.Tensor) -> torch.Tensor:
    """The ``attention_mask`` a model with the ``onepass_varlen`` backend takes for rows ``kv_end_BL``."""
    kv_end_BL = torch.as_tensor(kv_end_BL)
    if kv_end_BL.ndim == 1:
        kv_end_BL = kv_end_BL[None]
    B, L = kv_end_BL.shape
    mask_B11L = kv_end_BL.to(torch.long).reshape(B, 1, 1, L).clone()
    docs = documents(kv_end_BL)
    setattr(mask_B11L, _DOCS_ATTR, (torch.as_tensor(docs.cu_seqlens, device=kv_end_BL.device), docs.max_len))
    return mask_B11L


def onepass_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention function (``AttentionInterface``): [B, H, L, D] in, [B, L, H, D] out.

    Needs a :func:`varlen_attention_mask`; grouped-query attention runs as the kernel runs it
    (K key/value heads shared by H / K query heads each, not repeated)."""
    from torch.nn.attention.varlen import varlen_attn

    layer = getattr(module, "layer_idx", "?")
    docs = getattr(attention_mask, _DOCS_ATTR, None)
    if docs is None:
        raise VarlenError(f"{BACKEND} (layer {layer}) needs the mask of onepass.attention.varlen."
                          "varlen_attention_mask (onepass.attention.attention_mask_for builds it)")
    for name, given in {"dropout": dropout or None, "softcap": softcap, "sliding_window": sliding_window,
                        "sinks": kwargs.get("s_aux")}.items():
        if given is not None:
            raise VarlenError(f"{BACKEND} does not implement {name}={given!r} (layer {layer})")
    cu_seqlens, max_len = docs
    B, H, L, D = query.shape
    q_THD, k_TKD, v_TKD = (t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[-1]) for t in (query, key, value))
    out_THD = varlen_attn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling,
                          window_size=(-1, 0))  # (-1, 0): causal
    return out_THD.reshape(B, L, H, value.shape[-1]), None


def register() -> str:
    """Make ``attn_implementation="onepass_varlen"`` available to transformers (idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BACKEND, onepass_varlen_attention)
    AttentionMaskInterface.register(BACKEND, sdpa_mask)  # ours is 4-D and passes through untouched
    return BACKEND
