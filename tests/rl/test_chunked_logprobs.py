"""Per-token log-probs and entropies from the chunked LM head equal full logits, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from onepass.head import chunked_token_logprobs, logprobs_from_logits


@pytest.mark.parametrize("chunk", [1, 3, 512])
@pytest.mark.parametrize("kind", ["linear", "module"])
def test_chunked_equals_full_logits(chunk, kind):
    torch.manual_seed(0)
    linear = nn.Linear(8, 11, bias=True).double()
    head = linear if kind == "linear" else nn.Sequential(linear, nn.Tanh())  # any module head
    hidden = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    scale = torch.randn(7, dtype=torch.float64)

    def run(fn):
        head.zero_grad()
        hidden.grad = None
        lp, ent = fn()
        ((lp * scale).sum() + (ent * scale).sum()).backward()
        return lp.detach(), ent.detach(), hidden.grad.clone(), linear.weight.grad.clone()

    got = run(lambda: chunked_token_logprobs(hidden, head, targets, chunk=chunk, entropy=True))
    want = run(lambda: logprobs_from_logits(head(hidden), targets, entropy=True))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_no_targets_gives_empty_tensors():
    lp, ent = chunked_token_logprobs(torch.zeros(0, 4), nn.Linear(4, 5), torch.zeros(0, dtype=torch.long), entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
