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
original on a random input to float32 precision, so a norm with another
formula (e.g. Gemma's ``1 + weight``) is left alone and reported.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F


def _exact_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def float64_norms(model: Any) -> tuple[int, list[str]]:
    """Patch RMSNorm modules of ``model`` to compute in its dtype. Returns (patched, left alone)."""
    patched, skipped = 0, []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("RMSNorm"):
            continue
        weight = getattr(mod, "weight", None)
        if weight is None or not hasattr(mod, "variance_epsilon") or weight.dim() != 1:
            skipped.append(name)
            continue
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(3, weight.shape[0], generator=gen, dtype=weight.dtype).to(weight.device)
            agree = torch.allclose(mod(x), _exact_forward(mod, x), rtol=1e-5, atol=1e-6)
        if not agree:
            skipped.append(name)
            continue
        mod.forward = types.MethodType(_exact_forward, mod)
        patched += 1
    return patched, skipped
