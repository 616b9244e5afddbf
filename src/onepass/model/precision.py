"""True float64 for verification: HF RMSNorms upcast to float32 even in float64 models.

Why this module exists: transformers' RMSNorm does ``x.to(torch.float32)``
before normalising, whatever the model dtype. The one-pass and N-pass passes
feed it the same values in the forward pass, but in the backward pass a shared
tree node receives the *sum* of its views' gradients before that float32 step,
while N-pass sums after it, so the two round differently at float32 level
(~1e-8 relative in parameter gradients) although the math is identical.
To check equivalence at 1e-9 in float64, :func:`float64_norms` makes each
RMSNorm compute in the model's dtype. It is for verification, not training.

A norm is patched only after a check that the float64 form equals the
original on a random input to float32 precision (the Llama form ``weight * x``
or Gemma's ``(1 + weight) * x``); a norm with another formula is left alone
and reported. MoE top-k routers that take their logits in float32
(DeepSeek-V3, GLM-4-MoE) round the same way and are patched under the same
check (same experts chosen, same weights).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from onepass.model.couplings import upcast_kept_parameters
from onepass.model.float64 import float64_mixers


def _exact_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def _exact_offset_forward(self: Any, x: torch.Tensor) -> torch.Tensor:  # Gemma: (1 + weight), eps
    return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)


def _exact_router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3 / GLM-4-MoE ``TopkRouter.forward`` in the input's dtype instead of float32."""
    h = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(h, self.weight.to(h.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(scores.dtype)
    per_group = choice.view(-1, self.num_group, self.num_experts // self.num_group)
    group_idx = torch.topk(per_group.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(per_group.shape[:2], dtype=torch.bool, device=h.device).scatter_(1, group_idx, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, topk_weights * self.routed_scaling_factor, topk_indices


def _candidates(mod: Any) -> list[Any]:
    name, weight = type(mod).__name__, getattr(mod, "weight", None)
    if name.endswith("RMSNorm") and weight is not None and weight.dim() == 1:
        return [f for f, eps in ((_exact_forward, "variance_epsilon"), (_exact_offset_forward, "eps"))
                if hasattr(mod, eps)]
    if name.endswith("TopkRouter") and hasattr(mod, "e_score_correction_bias") and hasattr(mod, "num_group"):
        return [_exact_router_forward]
    return []


def _agrees(mod: Any, exact: Any) -> bool:
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, mod.weight.shape[-1], generator=gen, dtype=mod.weight.dtype).to(mod.weight.device)
        try:
            got, want = exact(mod, x), mod(x)
        except (AttributeError, RuntimeError, TypeError):
            return False
        if isinstance(want, tuple):  # a router: the same experts, the same weights
            return (len(got) == len(want) and torch.equal(got[2].sort(-1)[0], want[2].sort(-1)[0])
                    and torch.allclose(got[1].sort(-1)[0], want[1].sort(-1)[0].to(got[1].dtype), rtol=1e-5))
        return torch.allclose(want, got, rtol=1e-5, atol=1e-6)


def float64_norms(model: Any) -> tuple[int, list[str]]:
    """Patch RMSNorms (and float32 MoE routers) of ``model`` to compute in its dtype.

    Returns (patched, RMSNorms left alone).
    """
    upcast_kept_parameters(model)  # e.g. MoE router weights kept float32 in a float64 model
    patched, skipped = 0, []
    for name, mod in model.named_modules():
        candidates = _candidates(mod)
        exact = next((f for f in candidates if _agrees(mod, f)), None)
        if exact is not None:
            mod.forward = types.MethodType(exact, mod)
            patched += 1
        elif type(mod).__name__.endswith("RMSNorm"):
            skipped.append(name)

    float64_mixers(model)
    return patched, skipped
