"""The one-pass loss for a HF causal LM, and the plain N-pass reference it must equal.

Why this module exists: a row already holds shifted ``targets`` and their
``weights``, so the loss is one gather: run the model with the row's
``position_ids`` and tree mask, ask for logits only where there is a target
(``logits_to_keep``; the vocabulary projection is the largest matmul), and
sum ``cross_entropy * weight``. The reference runs each view alone, exactly as
a user would without onepass: a plain forward with no position ids and no
mask, full logits, the usual shift.

Legend: B batch, L row length, T targets in the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from onepass.attention.backends import attention_mask_for
from onepass.render import View
from onepass.tree import IGNORE, ROW_SCHEMA, Layout


def layouts_to_batch(layouts: Sequence[Layout], *, device: torch.device | str = "cpu"
                     ) -> dict[str, torch.Tensor]:
    """Stack rows into [B, L] tensors; shorter rows are padded with self-only, untrained positions."""
    length = max(len(x) for x in layouts)
    batch: dict[str, list[np.ndarray]] = {k: [] for k in ROW_SCHEMA}
    for x in layouts:
        pad = length - len(x)
        batch["input_ids"].append(np.pad(x.input_ids, (0, pad)))
        batch["position_ids"].append(np.pad(x.position_ids, (0, pad)))
        batch["kv_end"].append(np.concatenate([x.kv_end, np.arange(len(x), length) + 1]))
        batch["targets"].append(np.pad(x.targets, (0, pad), constant_values=IGNORE))
        batch["weights"].append(np.pad(x.weights, (0, pad)))
    return {k: torch.as_tensor(np.stack(v).astype(ROW_SCHEMA[k], copy=False), device=device)
            for k, v in batch.items()}


def weighted_ce(logits_TV: torch.Tensor, targets_T: torch.Tensor, weights_T: torch.Tensor) -> torch.Tensor:
    """Sum of ``cross_entropy * weight`` (half-precision logits are upcast to float32)."""
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    ce_T = F.cross_entropy(logits_TV, targets_T, reduction="none")
    return (ce_T * weights_T.to(ce_T.dtype)).sum()


class ForwardView:
    """What :func:`batch_loss` needs of a model: the wrapped forward (DDP, DeepSpeed, autocast)
    with the unwrapped model's ``config`` and ``dtype`` (the mask depends on them)."""

    def __init__(self, wrapped: Any, unwrapped: Any) -> None:
        self._wrapped = wrapped
        self.config = unwrapped.config
        self.dtype = unwrapped.dtype

    def __call__(self, **kwargs: Any) -> Any:
        return self._wrapped(**kwargs)


def batch_loss(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Weighted-sum loss of a batch of rows (no normalisation: the caller divides)."""
    targets_BL = batch["targets"]
    keep_BL = targets_BL != IGNORE
    mask = attention_mask_for(model, batch["kv_end"], position_ids_BL=batch["position_ids"])
    if targets_BL.shape[0] == 1:
        keep = keep_BL[0].nonzero().squeeze(1)  # 1-D indices: supported by every transformers 5.x
    else:
        keep = keep_BL  # 2-D bool: logits come back flattened to [T, V]
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=mask, logits_to_keep=keep, use_cache=False)
    logits_TV = out.logits.reshape(-1, out.logits.shape[-1])
    return weighted_ce(logits_TV, targets_BL[keep_BL], batch["weights"][keep_BL])


def layout_loss(model: Any, layout: Layout) -> torch.Tensor:
    """Weighted-sum loss of one row."""
    device = next(model.parameters()).device
    return batch_loss(model, layouts_to_batch([layout], device=device))


def view_loss_reference(model: Any, view: View, weight: float = 1.0) -> torch.Tensor:
    """The N-pass loss of one view: plain HF forward, full logits, standard shift.

    No position ids, no mask, nothing from onepass's layout: this is what the
    one-pass loss is checked against.
    """
    device = next(model.parameters()).device
    ids_1N = torch.as_tensor(view.tokens, device=device).long()[None]
    logits_NV = model(input_ids=ids_1N, use_cache=False).logits[0]
    first = max(view.num_prompt, 1)
    pred_TV = logits_NV[first - 1:-1]
    target_T = ids_1N[0, first:]
    if pred_TV.dtype in (torch.float16, torch.bfloat16):
        pred_TV = pred_TV.float()
    return F.cross_entropy(pred_TV, target_T, reduction="sum") * weight
