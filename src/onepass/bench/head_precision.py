"""The half-precision LM head's error against float64, beside a plain HF head in the same dtype (issue 42).

Why this module exists: "at the level of a plain HF head" is the claim for the chunked head
(:mod:`onepass.head`) in bf16/fp16, and two places check it: the suite's test (tests/test_head.py, small
shapes, CPU or CUDA) and the benchmark that reports the figure (benchmarks/head_precision.py). Both measure
with this one function, so the figure and the test are the same measurement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onepass.head import chunked_lm_head_loss


def half_head_errors(device: str, dtype: torch.dtype, seed: int, *, targets: int = 256, hidden: int = 128,
                     vocab: int = 2000, chunk: int = 64) -> tuple[list[float], list[float]]:
    """Relative errors ``[loss, dh, dW]`` (norm of the difference over the norm) against float64 on the same
    inputs, already representable in ``dtype`` (so the error is the arithmetic's): the chunked head in
    ``dtype``, and a plain HF head (``nn.Linear`` in ``dtype``, logits upcast, cross entropy). Returns
    ``(chunked, plain)``."""
    gen = torch.Generator().manual_seed(seed)
    weight_VD = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 3 / hidden ** 0.5).to(dtype).double()
    hidden_TD = torch.randn(targets, hidden, generator=gen, dtype=torch.float64).to(dtype).double()
    targets_T = torch.randint(0, vocab, (targets,), generator=gen)
    weights_T = torch.rand(targets, generator=gen, dtype=torch.float64)

    def run(loss_fn, dt):
        head = nn.Linear(hidden, vocab, bias=False, dtype=dt, device=device)
        with torch.no_grad():
            head.weight.copy_(weight_VD)
        h_TD = hidden_TD.detach().to(device, dt).requires_grad_(True)
        loss = loss_fn(h_TD, head, targets_T.to(device), weights_T.to(device))
        loss.backward()
        return [x.detach().double().cpu() for x in (loss, h_TD.grad, head.weight.grad)]

    def chunked(h, head, t, w):
        return chunked_lm_head_loss(h, head, t, w, chunk=chunk)

    def plain(h, head, t, w):
        return (F.cross_entropy(head(h).float(), t, reduction="none") * w.float()).sum()

    want = run(chunked, torch.float64)

    def rel(got):
        return [float((g - r).norm() / r.norm()) for g, r in zip(got, want)]

    return rel(run(chunked, dtype)), rel(run(plain, dtype))
