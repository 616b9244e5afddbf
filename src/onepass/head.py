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
an identity (:func:`head_as_identity`), so the "logits" it returns (at every
position: the loss gathers the targets' by index) are the hidden states; the
first call checks the model returned them unchanged (else, e.g. Gemma's
softcapping, it takes the plain path), then this module projects them.

The slow reference is :func:`plain_lm_head_loss` (full logits, then
:func:`weighted_ce`); tests/test_head.py holds them equal in
float64 to 1e-12 for every gradient.

Optional fast kernel: with ``ONEPASS_LM_HEAD=cce`` on CUDA and Apple's
cut-cross-entropy importable, a plain Linear head goes through its
``linear_cross_entropy``. It is opt-in because it is not exact (bf16 logits,
gradient filtering) and it is untested here (no GPU in CI).

Precision, one rule for every head matmul (:func:`head_dtype`): the matmuls take their inputs in
the dtype the model's own head would have computed in (the autocast dtype when the model's forward
ran under autocast, else the weight's) and accumulate in float32 when that is bf16 or fp16:
``logits = h W^T``, ``dh = g W`` and ``dW += g^T h`` on tensor cores with float32 sums and float32
outputs where the device has such a GEMM (CUDA: ``torch.mm(..., out_dtype=torch.float32)``, probed
once on first use, :func:`fp32_out_gemm`), the weight gradient summed over chunks in float32
(in place where ``addmm`` takes a float32 sum, :func:`fp32_sum_gemm`, else slice by slice) and
rounded once. Elsewhere (CPU) the logits and ``dh`` are the half-precision GEMM's (float32
sums, half outputs, as a plain ``nn.Linear`` gives them) and ``dW`` the float32 GEMM (on the float32
softmax gradient). float32 and
float64 heads run the ops they always ran (bitwise). A half weight under another half autocast
(fp16 weights, bf16 mixed precision) computes in the autocast dtype, as the model's own head does.
Measured against float64 (docs/measured.md, tests/test_head.py): the bf16 head's loss and
gradients are at least as close as a plain bf16 ``nn.Linear`` + cross entropy.

Legend: T targets, D hidden, V vocabulary, C chunk.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
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


HALF = (torch.float16, torch.bfloat16)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on ``device_type`` here, or None when autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def head_dtype(weight_dtype: torch.dtype, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype of the head matmuls' inputs: what the model's own ``nn.Linear`` head would multiply in.

    Under autocast (``autocast``: its dtype, as the model's forward saw it) a float32 or half weight
    is multiplied in the autocast dtype (fp16 weights under bf16 mixed precision: bf16); float64 is
    never cast (autocast leaves it); without autocast, the weight's dtype.
    """
    if autocast is not None and weight_dtype != torch.float64:
        return autocast
    return weight_dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the head sums: float32 for half inputs, else the inputs' own dtype."""
    return torch.float32 if dtype in HALF else dtype


def _probe_operands(device_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two small bf16 matrices on ``device_type`` and their exact product (float64, on the host)."""
    gen = torch.Generator().manual_seed(0)
    a_MK, b_KN = torch.randn(16, 64, generator=gen), torch.randn(64, 24, generator=gen)
    want_MN = a_MK.bfloat16().double() @ b_KN.bfloat16().double()
    return a_MK.to(device_type, torch.bfloat16), b_KN.to(device_type, torch.bfloat16), want_MN


def _sums_in_float32(got_MN: torch.Tensor, want_MN: torch.Tensor) -> bool:
    """A float32 result of a bf16 GEMM that summed in float32: ~1e-7 from the exact product (a half output: ~1e-3)."""
    return got_MN.dtype == torch.float32 and float((got_MN.double().cpu() - want_MN).abs().max()) < 1e-4


@functools.cache
def fp32_out_gemm(device_type: str) -> bool:
    """Whether this torch on ``device_type`` multiplies half matrices into a float32 output
    (``torch.mm(..., out_dtype=torch.float32)``: tensor cores, float32 sums, no half rounding of the result;
    torch >= 2.8 on CUDA). Probed once, on first use, against a float64 product."""
    a_MK, b_KN, want_MN = _probe_operands(device_type)
    try:
        return _sums_in_float32(torch.mm(a_MK, b_KN, out_dtype=torch.float32), want_MN)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.cache
def fp32_sum_gemm(device_type: str) -> bool:
    """Whether this torch on ``device_type`` adds a half product into an existing float32 matrix in place
    (``torch.addmm(sum, a, b, out_dtype=torch.float32, out=sum)`` with a float32 ``sum``). Some releases
    with :func:`fp32_out_gemm` refuse it ("self and mat2 must have the same dtype"); the weight gradient then
    adds float32 products a slice at a time (:func:`_addmm_`). Probed once, on first use."""
    if not fp32_out_gemm(device_type):
        return False
    a_MK, b_KN, want_MN = _probe_operands(device_type)
    sum_MN = torch.ones(a_MK.shape[0], b_KN.shape[1], device=device_type)
    try:
        torch.addmm(sum_MN, a_MK, b_KN, out_dtype=torch.float32, out=sum_MN)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return _sums_in_float32(sum_MN - 1, want_MN)


SUM_SLICE = 8192  # rows of dW per float32 product where addmm cannot sum in place: a bounded scratch ([8192, D])


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` summed in ``acc`` and returned in ``acc`` (half inputs: float32 out where the device can)."""
    if a.dtype != acc and fp32_out_gemm(a.device.type):
        return torch.mm(a, b, out_dtype=acc)
    return (a @ b).to(acc)


def _addmm_(sum_: torch.Tensor, a: torch.Tensor, b: torch.Tensor, compute: torch.dtype) -> None:
    """``sum_ += a @ b`` summed in ``sum_``'s dtype: ``a`` (in that dtype) rounded to ``compute`` on tensor cores
    where the device has a float32-output half GEMM (in place, else a float32 product per slice of
    :data:`SUM_SLICE` rows, added), else the float32 GEMM on ``a`` as it is."""
    device = a.device.type
    if compute == sum_.dtype or not fp32_out_gemm(device):
        sum_.addmm_(a, b.to(sum_.dtype))
        return
    a = a.to(compute)
    if fp32_sum_gemm(device):
        torch.addmm(sum_, a, b, out_dtype=sum_.dtype, out=sum_)
        return
    for start in range(0, a.shape[0], SUM_SLICE):
        sum_[start:start + SUM_SLICE].add_(torch.mm(a[start:start + SUM_SLICE], b, out_dtype=sum_.dtype))


@dataclass(frozen=True, kw_only=True, slots=True)
class _Operands:
    """The head's matmul operands in the one dtype (:func:`head_dtype`), cast once per call."""

    weight_VD: torch.Tensor  # in the compute dtype
    bias_V: torch.Tensor | None  # in the accumulate dtype
    compute: torch.dtype
    acc: torch.dtype

    @classmethod
    def of(cls, weight_VD: torch.Tensor, bias_V: torch.Tensor | None,
           autocast: torch.dtype | None) -> _Operands:
        compute = head_dtype(weight_VD.dtype, autocast)
        acc = accumulate_dtype(compute)
        return cls(weight_VD=weight_VD.to(compute), bias_V=None if bias_V is None else bias_V.to(acc),
                   compute=compute, acc=acc)

    def logits(self, hidden_CD: torch.Tensor) -> torch.Tensor:
        """``h W^T + b`` in the accumulate dtype."""
        if self.compute not in HALF:  # float32 / float64: the op it always was
            return F.linear(hidden_CD.to(self.compute), self.weight_VD, self.bias_V)
        logits_CV = _mm(hidden_CD.to(self.compute), self.weight_VD.t(), self.acc)
        return logits_CV if self.bias_V is None else logits_CV.add_(self.bias_V)


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_t w_t * CE(h_t W^T + b, y_t), chunk by chunk; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx: Any, hidden_TD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None,
                targets_T: torch.Tensor, weights_T: torch.Tensor, chunk: int,
                stats: dict[str, torch.Tensor] | None = None, autocast: torch.dtype | None = None) -> torch.Tensor:
        ops = _Operands.of(weight_VD, bias_V, autocast)
        lse_parts, total = [], None
        for start in range(0, hidden_TD.shape[0], chunk):
            logits_CV = ops.logits(hidden_TD[start:start + chunk])
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
            total = hidden_TD.new_zeros((), dtype=torch.promote_types(ops.acc, torch.float32))
            lse_T = hidden_TD.new_zeros(0, dtype=total.dtype)
        else:
            lse_T = torch.cat(lse_parts)
        ctx.save_for_backward(hidden_TD, weight_VD, bias_V, targets_T, weights_T, lse_T)
        ctx.chunk, ctx.autocast = chunk, autocast
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_TD, weight_VD, bias_V, targets_T, weights_T, lse_T = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        ops = _Operands.of(weight_VD, bias_V, ctx.autocast)
        grad_h = torch.empty_like(hidden_TD) if need_h else None
        grad_w = torch.zeros_like(weight_VD, dtype=lse_T.dtype) if need_w else None  # float32 sum over chunks
        grad_b = torch.zeros_like(bias_V, dtype=lse_T.dtype) if need_b else None
        for start in range(0, hidden_TD.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            h_CD = hidden_TD[start:stop]
            # softmax in place in the logits' buffer, and that buffer freed before the next chunk's:
            # one [C, V] alive at a time (else a row with more chunks, e.g. a one-pass row, peaks higher)
            g_CV = ops.logits(h_CD).sub_(lse_T[start:stop, None]).exp_()
            g_CV.scatter_add_(1, targets_T[start:stop, None],
                              torch.full_like(lse_T[start:stop, None], -1.0))
            g_CV.mul_((weights_T[start:stop].to(g_CV.dtype) * grad_out)[:, None])
            if ops.compute in HALF:  # tensor cores: half inputs, float32 sums (and outputs where the device can)
                g_half_CV = g_CV.to(ops.compute)
                if need_h:
                    grad_h[start:stop] = _mm(g_half_CV, ops.weight_VD, ops.acc).to(hidden_TD.dtype)
                if need_w:
                    _addmm_(grad_w, g_CV.t(), h_CD.to(ops.compute), ops.compute)
                del g_half_CV
            else:  # float32 / float64: the ops they always were
                if need_h:
                    grad_h[start:stop] = (g_CV.to(weight_VD.dtype) @ weight_VD).to(hidden_TD.dtype)  # as autograd
                if need_w:
                    grad_w.addmm_(g_CV.t(), h_CD.to(g_CV.dtype))
            if need_b:
                grad_b.add_(g_CV.sum(0))
            del g_CV
        return (grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype),
                None if grad_b is None else grad_b.to(bias_V.dtype), None, None, None, None, None)


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


def _as_model_head(autocast: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """A module head called here runs under the autocast its model's forward ran under (its own dtype rule)."""
    return torch.autocast(device_type, dtype=autocast) if autocast is not None else contextlib.nullcontext()


def head_stats(stats: dict[str, torch.Tensor], hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor,
               weights_T: torch.Tensor, chunk: int, *, autocast: torch.dtype | None = None) -> None:
    """:func:`add_logit_stats` for a head whose logits the loss does not hand back (one more
    projection, chunk by chunk, without gradient)."""
    with torch.no_grad(), _as_model_head(autocast, hidden_TD.device.type):
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


def _linear_ce(hidden_TD: torch.Tensor, head: nn.Linear, targets_T: torch.Tensor, weights_T: torch.Tensor,
               chunk: int, stats: dict[str, torch.Tensor] | None, autocast: torch.dtype | None) -> torch.Tensor:
    """:class:`_ChunkedLinearCE` on the head's device, outside autocast: its dtype rule is :func:`head_dtype`'s."""
    device = head.weight.device  # a device_map model may keep the head on another GPU
    with torch.autocast(device.type, enabled=False):
        return _ChunkedLinearCE.apply(hidden_TD.to(device), head.weight, head.bias, targets_T.to(device),
                                      weights_T.to(device), chunk, stats, autocast)


def chunked_lm_head_loss(hidden_TD: torch.Tensor, head: nn.Module, targets_T: torch.Tensor,
                         weights_T: torch.Tensor, *, chunk: int | None = None, mode: str | None = None,
                         stats: dict[str, torch.Tensor] | None = None,
                         autocast: torch.dtype | None = None) -> torch.Tensor:
    """``sum_t weights_T[t] * cross_entropy(head(hidden_TD[t]), targets_T[t])`` without [T, V] logits.

    ``head`` is the model's output embedding module (``model.get_output_embeddings()``).
    Equal to :func:`plain_lm_head_loss` (float64: to rounding) for any chunk >= 1.
    ``stats``: a dict that :func:`add_logit_stats` adds the accuracy and entropy sums to.
    ``autocast``: the dtype the model's forward ran under autocast in (:func:`head_as_identity` sees it),
    else the autocast in effect here, if any: the head multiplies as the model's own would (:func:`head_dtype`).
    """
    mode, chunk = head_mode(mode), head_chunk(chunk)
    targets_T = targets_T.long()
    autocast = autocast or autocast_dtype(hidden_TD.device.type)
    if mode == "plain":
        with _as_model_head(autocast, hidden_TD.device.type):
            return plain_lm_head_loss(hidden_TD, head, targets_T, weights_T, stats=stats)
    if type(head) is nn.Linear and not (mode == "cce" and hidden_TD.is_cuda):
        return _linear_ce(hidden_TD, head, targets_T, weights_T, chunk, stats, autocast)
    if stats is not None:
        head_stats(stats, hidden_TD, head, targets_T, weights_T, chunk, autocast=autocast)
    if type(head) is nn.Linear:  # pragma: no cover - needs CUDA
        try:
            return _cce_loss(head, hidden_TD, targets_T, weights_T)
        except ImportError:
            return _linear_ce(hidden_TD, head, targets_T, weights_T, chunk, None, autocast)
    total = None
    with _as_model_head(autocast, hidden_TD.device.type):  # checkpoint's recompute keeps it
        for start in range(0, hidden_TD.shape[0], chunk):
            part = checkpoint(_module_chunk_loss, head, hidden_TD[start:start + chunk],
                              targets_T[start:start + chunk], weights_T[start:start + chunk], use_reentrant=False)
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


@dataclass(kw_only=True, slots=True)
class HeadCalls:
    """What the model's forward gave its (identity) head: each tensor, and the autocast dtype it ran under
    (None: no autocast), which the head's own matmul would have used (:func:`head_dtype`)."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    autocast: torch.dtype | None = None


@contextlib.contextmanager
def head_as_identity(head: nn.Module) -> Iterator[HeadCalls]:
    """Inside, ``head(x)`` returns ``x``: the model's forward then hands back the hidden states it would project.

    Yields a :class:`HeadCalls` that receives each tensor the head was given, so the caller can
    check the model returned it unchanged, and the autocast in effect there. Restores any
    instance-level forward (accelerate's device hooks) on exit.
    """
    seen = HeadCalls()
    had_own = "forward" in vars(head)
    own = vars(head).get("forward")

    trainable = [p for p in head.parameters() if p.requires_grad]

    def identity(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.hidden.append(hidden)
        seen.autocast = autocast_dtype(hidden.device.type)
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
                           chunk: int | None = None, entropy: bool = False, autocast: torch.dtype | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-target log-prob ``log softmax(head(hidden))[target]`` (and entropy), ``chunk`` targets at a time.

    Each chunk runs under non-reentrant checkpointing: forward keeps [C] values, backward
    recomputes the chunk's [C, V] logits, so [T, V] never exists. The RL losses take these
    per token (:mod:`onepass.rl`); the slow reference is :func:`logprobs_from_logits` on the
    full logits. Any module head works (a LoRA'd Linear runs its own forward); ``autocast``: as
    :func:`chunked_lm_head_loss`'s.
    """
    chunk = head_chunk(chunk)
    device = next(head.parameters()).device  # a device_map model may keep the head on another GPU
    hidden_TD, targets_T = hidden_TD.to(device), targets_T.to(device)
    picked, entropies = [], []
    with _as_model_head(autocast or autocast_dtype(device.type), device.type):
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
