"""The attention mask a HF model needs for a batch of rows, by attention backend.

Why this module exists: every backend consumes the same row format
(``kv_end``); only the mask object differs. This is the one place that
knows which object each backend takes:

    onepass_cpu        int64 [B, 1, 1, L]     kv_end + segment plan: only visible pairs (CPU)
    sdpa               bool [B, 1, L, L]      True = may attend
    eager              float [B, 1, L, L]     0 / finfo.min, added to the scores
    flex_attention     BlockMask              blocks with no visible pair are skipped
    flash_attention_*  refused                it cannot express a tree mask

Transformers passes a 4D mask (or a BlockMask) through untouched, so the
model never guesses sequence boundaries from the position ids (with
``attention_mask=None`` and non-monotonic position ids it would).
"""

from __future__ import annotations

from typing import Any

import torch

from onepass.attention.blocks import block_mask
from onepass.attention.cpu import BACKEND as ONEPASS_CPU
from onepass.attention.cpu import cpu_attention_mask
from onepass.attention.cpu import register as register_onepass_cpu
from onepass.attention.mask import additive_mask, dense_mask

BACKENDS = ("onepass_cpu", "sdpa", "eager", "flex_attention")


def default_backend(device: torch.device | str) -> str:
    """``onepass_cpu`` on CPU (computes only visible pairs), ``flex_attention`` on CUDA, else sdpa.

    Registers ``onepass_cpu`` with transformers, so call it before loading a model with it.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return register_onepass_cpu()
    return "flex_attention" if kind == "cuda" else "sdpa"


class BackendError(ValueError):
    """An attention backend that cannot serve a tree mask here."""


def model_backend(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def check_backend(backend: str, device: torch.device | str) -> None:
    """Raise a clear :class:`BackendError` when ``backend`` cannot train tree rows on ``device``."""
    if backend.startswith("flash_attention"):
        raise BackendError(f"{backend} cannot apply a tree mask (it supports causal and varlen only); "
                           "use sdpa, eager or flex_attention")
    if backend not in BACKENDS:
        raise BackendError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "flex_attention" and torch.device(device).type == "cpu":
        raise BackendError("flex_attention has no backward pass on CPU; use onepass_cpu, sdpa or eager on CPU")
    if backend == ONEPASS_CPU and torch.device(device).type != "cpu":
        raise BackendError("onepass_cpu runs on CPU only; on CUDA use flex_attention (block-sparse) or sdpa")


def attention_mask_for(model: Any, kv_end_BL: torch.Tensor, *, dtype: torch.dtype | None = None,
                       block_size: int = 128) -> Any:
    """The mask object ``model`` takes for rows with ``kv_end_BL`` (already on the model's device)."""
    backend = model_backend(model)
    if backend.startswith("flash_attention"):
        check_backend(backend, kv_end_BL.device)
    if backend == ONEPASS_CPU:
        return cpu_attention_mask(kv_end_BL)
    if backend == "flex_attention":  # built from the block plan: no L x L evaluation
        return block_mask(kv_end_BL, block_size=block_size, device=kv_end_BL.device)
    mask_BLL = dense_mask(kv_end_BL)
    mask_B1LL = mask_BLL[:, None]
    if backend == "sdpa":
        return mask_B1LL
    return additive_mask(mask_B1LL, dtype or model.dtype)
