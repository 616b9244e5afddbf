"""The LM head and its cross-entropy in chunks of targets, never holding [T, V] logits.

Why this module exists: at a real vocabulary (Qwen3: 151,936 ids) the logits of
the trained positions and their gradient are the largest tensors of a step:
T = 4,096 targets x V x 4 bytes is 2.5 GB, twice over in backward. A one-pass
row holds more targets than any single view, so without this the LM head, not
attention, sets the peak. Here the projection, log-softmax and weighted CE run
``chunk`` targets at a time; backward recomputes each chunk's logits, so at most
[chunk, V] floats live at once (the [V, D] weight gradient is needed anyway).

Worked example (T = 5 targets, chunk = 2): rows {0,1}, {2,3}, {4} each compute
``logits = h @ W^T (+ b)``, ``lse = logsumexp(logits)``, ``loss += sum(w * (lse - logits[t]))``;
forward keeps only ``lse`` (T floats). Backward, per chunk:
``g = (softmax - onehot(t)) * w``, ``dh = g @ W``, ``dW += g^T @ h``, ``db += sum(g)``.

Two exact routes, picked by the head module:

- ``nn.Linear`` (plain or tied to the input embedding: the weight is one
  Parameter, so autograd sums both gradients into it): :class:`_ChunkedLinearCE`,
  a hand-written autograd Function with the recompute above.
- anything else (a peft LoRA ``Linear``, a quantised layer): each chunk calls the
  module itself under non-reentrant ``torch.utils.checkpoint``, so the module's
  own forward (LoRA's ``W x + B A x * s``, dropout included) is what runs and is
  differentiated; the recompute happens chunk by chunk in backward.

How it plugs into a HF model (:func:`onepass.loss.batch_loss`): the model runs
its own forward through every wrapper (DDP, autocast, peft) with the head made
an identity (:func:`head_as_identity`), so the "logits" it returns at the
target positions are the hidden states; the first call checks the model
returned them unchanged (else, e.g. Gemma's softcapping, it takes the plain
path), then this module projects them.

The slow reference is :func:`plain_lm_head_loss` (full logits, then
:func:`weighted_ce`); tests/test_head.py holds them equal in
float64 to 1e-12 for every gradient.

Optional fast kernel: with ``ONEPASS_LM_HEAD=cce`` on CUDA and Apple's
cut-cross-entropy importable, a plain Linear head goes through its
``linear_cross_entropy``. It is opt-in because it is not exact (bf16 logits,
gradient filtering) and it is untested here (no GPU in CI).

Legend: T targets, D hidden, V vocabulary, C chunk.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from onepass.model.config import text_config

DEFAULT_CHUNK = 512  # [512, 151936] float32 = 0.3 GB transient; big enough to keep a GPU busy
# A row's head buffer is min(targets, chunk) x V: a smaller chunk also bounds how much more a row with more
# targets (one-pass) can hold than one with fewer (N-pass). 512 vs 1024: same CPU time within noise
# (2,400 targets, 151,936 ids, forward + backward).
MODES = ("chunked", "plain", "cce")
MODE_ENV = "ONEPASS_LM_HEAD"  # chunked (default) | plain | cce
CHUNK_ENV = "ONEPASS_LM_HEAD_CHUNK"


def head_mode(mode: str | None = None) -> str:
    """The LM-head route: the argument, else ``$ONEPASS_LM_HEAD``, else ``chunked``."""
    mode = mode or os.environ.get(MODE_ENV) or "chunked"
    if mode not in MODES:
        raise ValueError(f"LM head mode {mode!r} is not one of {MODES} (argument or ${MODE_ENV})")
    return mode


def head_chunk(chunk: int | None = None) -> int:
    """The chunk size: the argument, else ``$ONEPASS_LM_HEAD_CHUNK``, else :data:`DEFAULT_CHUNK`."""
    chunk = chunk or int(os.environ.get(CHUNK_ENV) or DEFAULT_CHUNK)
    if chunk < 1:
        raise ValueError(f"LM head chunk must be >= 1, got {chunk}")
    return chunk


def _float_logits(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None) -> torch.Tensor:
    logits_CV = F.linear(hidden_CD, weight_VD, bias_V)
    return logits_CV.float() if logits_CV.dtype in (torch.float16, torch.bfloat16) else logits_CV


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_t w_t * CE(h_t W^T + b, y_t), chunk by chunk; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx: Any, hidden_TD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None,
                targets_T: torch.Tensor, weights_T: torch.Tensor, chunk: int,
                stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        lse_parts, total = [], None
        for start in range(0, hidden_TD.shape[0], chunk):
            logits_CV = _float_logits(hidden_TD[start:start + chunk], weight_VD, bias_V)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            if stats is not None:
                add_logit_stats(stats, logits_CV, targets_T[start:start + chunk], weights_T[start:start + chunk],
                                lse_C=lse_C)
            picked_C = logits_CV.gather(1, targets_T[start:start + chunk, None]).squeeze(1)
            part = ((lse_C - picked_C) * weights_T[start:start + chunk].to(lse_C.dtype)).sum()
            total = part if total is None else total + part
            lse_parts.append(lse_C)
            del logits_CV  # before the next chunk's: one [C, V] at a time, however many chunks
        if total is None:  # no targets: a zero that still depends on the weight's dtype
            total = hidden_TD.new_zeros((), dtype=torch.promote_types(hidden_TD.dtype, torch.float32))
            lse_T = hidden_TD.new_zeros(0, dtype=total.dtype)
        else:
            lse_T = torch.cat(lse_parts)
        ctx.save_for_backward(hidden_TD, weight_VD, bias_V, targets_T, weights_T, lse_T)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_TD, weight_VD, bias_V, targets_T, weights_T, lse_T = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_TD) if need_h else None
        grad_w = torch.zeros_like(weight_VD, dtype=lse_T.dtype) if need_w else None  # float32 sum over chunks
        grad_b = torch.zeros_like(bias_V, dtype=lse_T.dtype) if need_b else None
        for start in range(0, hidden_TD.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            h_CD = hidden_TD[start:stop]
            # softmax in place in the logits' buffer, and that buffer freed before the next chunk's:
            # one [C, V] alive at a time (else a row with more chunks, e.g. a one-pass row, peaks higher)
            g_CV = _float_logits(h_CD, weight_VD, bias_V).sub_(lse_T[start:stop, None]).exp_()
            g_CV.scatter_add_(1, targets_T[start:stop, None],
                              torch.full_like(lse_T[start:stop, None], -1.0))
            g_CV.mul_((weights_T[start:stop].to(g_CV.dtype) * grad_out)[:, None])
            if need_h:
                grad_h[start:stop] = (g_CV.to(weight_VD.dtype) @ weight_VD).to(hidden_TD.dtype)  # as autograd would
            if need_w:
                grad_w.addmm_(g_CV.t(), h_CD.to(g_CV.dtype))
            if need_b:
                grad_b.add_(g_CV.sum(0))
            del g_CV
        return (grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype),
                None if grad_b is None else grad_b.to(bias_V.dtype), None, None, None, None)


def weighted_ce(logits_TV: torch.Tensor, targets_T: torch.Tensor, weights_T: torch.Tensor) -> torch.Tensor:
    """Sum of ``cross_entropy * weight`` (half-precision logits are upcast to float32)."""
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    ce_T = F.cross_entropy(logits_TV, targets_T, reduction="none")
    return (ce_T * weights_T.to(ce_T.dtype)).sum()


STAT_KEYS = ("weight", "correct", "entropy")


def add_logit_stats(stats: dict[str, torch.Tensor], logits_CV: torch.Tensor, targets_C: torch.Tensor,
                    weights_C: torch.Tensor, *, lse_C: torch.Tensor | None = None) -> None:
    """Add to ``stats`` the target weight, the weight of targets that are the argmax, and the
    weighted entropy of the predicted distribution (TRL's ``mean_token_accuracy`` and ``entropy``
    are ``correct / weight`` and ``entropy / weight``). No gradient; tensors, so no device sync."""
    with torch.no_grad():
        logits_CV = logits_CV.detach().float()
        lse_C = torch.logsumexp(logits_CV, dim=-1) if lse_C is None else lse_C.detach().float()
        w_C = weights_C.detach().float()
        entropy_C = lse_C - (torch.softmax(logits_CV, dim=-1) * logits_CV).sum(-1)
        correct_C = (logits_CV.argmax(-1) == targets_C).float()
        for key, value in (("weight", w_C.sum()), ("correct", (correct_C * w_C).sum()),
                           ("entropy", (entropy_C * w_C).sum())):
            stats[key] = stats[key] + value if key in stats else value


def head_stats(stats: dict[str, torch.Tensor], hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor,
               weights_T: torch.Tensor, chunk: int) -> None:
    """:func:`add_logit_stats` for a head whose logits the loss does not hand back (one more
    projection, chunk by chunk, without gradient)."""
    with torch.no_grad():
        for start in range(0, hidden_TD.shape[0], chunk):
            add_logit_stats(stats, head(hidden_TD[start:start + chunk].detach()), targets_T[start:start + chunk],
                            weights_T[start:start + chunk])


def _module_chunk_loss(head: nn.Module, hidden_CD: torch.Tensor, targets_C: torch.Tensor,
                       weights_C: torch.Tensor) -> torch.Tensor:
    return weighted_ce(head(hidden_CD), targets_C, weights_C)


def _cce_loss(head: nn.Linear, hidden_TD: torch.Tensor, targets_T: torch.Tensor,
              weights_T: torch.Tensor) -> torch.Tensor:  # pragma: no cover - CUDA + cut-cross-entropy only
    from cut_cross_entropy import linear_cross_entropy
    ce_T = linear_cross_entropy(hidden_TD, head.weight, targets_T, bias=head.bias, reduction="none")
    return (ce_T.float() * weights_T.float()).sum()


def chunked_lm_head_loss(hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor,
                         weights_T: torch.Tensor, *, chunk: int | None = None, mode: str | None = None,
                         stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_t weights_T[t] * cross_entropy(head(hidden_TD[t]), targets_T[t])`` without [T, V] logits.

    ``head`` is the model's output embedding module (``model.get_output_embeddings()``).
    Equal to :func:`plain_lm_head_loss` (float64: to rounding) for any chunk >= 1.
    ``stats``: a dict that :func:`add_logit_stats` adds the accuracy and entropy sums to.
    """
    mode, chunk = head_mode(mode), head_chunk(chunk)
    targets_T = targets_T.long()
    if mode == "plain":
        return plain_lm_head_loss(hidden_TD, head, targets_T, weights_T, stats=stats)
    if type(head) is nn.Linear and not (mode == "cce" and hidden_TD.is_cuda):
        device = head.weight.device  # a device_map model may keep the head on another GPU
        return _ChunkedLinearCE.apply(hidden_TD.to(device), head.weight, head.bias, targets_T.to(device),
                                      weights_T.to(device), chunk, stats)
    if stats is not None:
        head_stats(stats, hidden_TD, head, targets_T, weights_T, chunk)
    if type(head) is nn.Linear:  # pragma: no cover - needs CUDA
        try:
            return _cce_loss(head, hidden_TD, targets_T, weights_T)
        except ImportError:
            device = head.weight.device
            return _ChunkedLinearCE.apply(hidden_TD.to(device), head.weight, head.bias, targets_T.to(device),
                                          weights_T.to(device), chunk, None)
    total = None
    for start in range(0, hidden_TD.shape[0], chunk):
        part = checkpoint(_module_chunk_loss, head, hidden_TD[start:start + chunk], targets_T[start:start + chunk],
                          weights_T[start:start + chunk], use_reentrant=False)
        total = part if total is None else total + part
    if total is None:
        return plain_lm_head_loss(hidden_TD, head, targets_T, weights_T)
    return total


# config fields of models that transform the logits after the head (Gemma softcap, Granite, Cohere):
# the model's own forward must apply them, so those models take the plain path
_POST_HEAD_FIELDS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "unpadded_vocab_size")


def head_of(model: Any) -> nn.Module | None:
    """The module that maps hidden states to logits, or None where the chunked head cannot stand in for it.

    None when the model has no ``get_output_embeddings`` or its config names a
    post-head transform (see ``_POST_HEAD_FIELDS``); the caller then uses the plain path.
    """
    config = getattr(model, "config", None)
    text = text_config(config)
    if any(getattr(c, f, None) is not None for c in (config, text) for f in _POST_HEAD_FIELDS):
        return None
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    return head if isinstance(head, nn.Module) else None


class _UsesParams(torch.autograd.Function):
    """``hidden`` unchanged, with the head's parameters as inputs of its graph node and no gradient for them.

    DDP with ``find_unused_parameters=True`` (HF Trainer's default) walks the output's graph
    at the end of forward and marks every parameter it cannot reach as ready; the head's
    would then be marked a second time when the chunked loss's backward reaches it.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.num_params = len(params)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *([None] * ctx.num_params))


@contextlib.contextmanager
def head_as_identity(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside, ``head(x)`` returns ``x``: the model's forward then hands back the hidden states it would project.

    Yields a list that receives each tensor the head was given, so the caller can
    check the model returned it unchanged. Restores any instance-level forward
    (accelerate's device hooks) on exit.
    """
    seen: list[torch.Tensor] = []
    had_own = "forward" in vars(head)
    own = vars(head).get("forward")

    trainable = [p for p in head.parameters() if p.requires_grad]

    def identity(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(hidden)
        return _UsesParams.apply(hidden, *trainable) if trainable and torch.is_grad_enabled() else hidden

    head.forward = identity
    try:
        yield seen
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def plain_lm_head_loss(hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor,
                       weights_T: torch.Tensor, *, stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The reference: full [T, V] logits, then the weighted CE sum."""
    logits_TV = head(hidden_TD)
    if stats is not None:
        add_logit_stats(stats, logits_TV, targets_T.long(), weights_T)
    return weighted_ce(logits_TV, targets_T.long(), weights_T)


def logprobs_from_logits(logits_TV: torch.Tensor, targets_T: torch.Tensor, *, entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits)[t]`` per row (half precision upcast to float32), and the entropy if asked."""
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    picked_T = logp_TV.gather(1, targets_T.long()[:, None]).squeeze(1)
    return picked_T, (-(logp_TV.exp() * logp_TV).sum(-1) if entropy else None)


def _module_chunk_logprobs(head: nn.Module, hidden_CD: torch.Tensor, targets_C: torch.Tensor,
                           entropy: bool) -> tuple[torch.Tensor, ...]:
    picked_C, entropy_C = logprobs_from_logits(head(hidden_CD), targets_C, entropy=entropy)
    return (picked_C,) if entropy_C is None else (picked_C, entropy_C)


def chunked_token_logprobs(hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor, *,
                           chunk: int | None = None, entropy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-target log-prob ``log softmax(head(hidden))[target]`` (and entropy), ``chunk`` targets at a time.

    Each chunk runs under non-reentrant checkpointing: forward keeps [C] values, backward
    recomputes the chunk's [C, V] logits, so [T, V] never exists. The RL losses take these
    per token (:mod:`onepass.rl`); the slow reference is :func:`logprobs_from_logits` on the
    full logits. Any module head works (a LoRA'd Linear runs its own forward).
    """
    chunk = head_chunk(chunk)
    device = next(head.parameters()).device  # a device_map model may keep the head on another GPU
    hidden_TD, targets_T = hidden_TD.to(device), targets_T.to(device)
    picked, entropies = [], []
    for start in range(0, hidden_TD.shape[0], chunk):
        args = (head, hidden_TD[start:start + chunk], targets_T[start:start + chunk], entropy)
        out = checkpoint(_module_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() \
            else _module_chunk_logprobs(*args)
        picked.append(out[0])
        if entropy:
            entropies.append(out[1])
    if not picked:
        empty = hidden_TD.new_zeros(0, dtype=torch.promote_types(hidden_TD.dtype, torch.float32))
        return empty, (empty if entropy else None)
    return torch.cat(picked), (torch.cat(entropies) if entropy else None)
