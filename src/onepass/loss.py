"""The one-pass loss for a HF causal LM, and the plain N-pass reference it must equal.

Why this module exists: a row already holds shifted ``targets`` and their
``weights``, so the loss is one gather: run the model with the row's
``position_ids`` and tree mask, ask for logits only where there is a target
(``logits_to_keep``; the vocabulary projection is the largest matmul), and
sum ``cross_entropy * weight``; the head and its CE run in chunks of targets
(:mod:`onepass.head`), so [T, V] logits never exist. The reference runs each view alone, exactly as
a user would without onepass: a plain forward with no position ids and no
mask, full logits, the usual shift.

Legend: B batch, L row length, T targets in the batch, V vocabulary.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from onepass.attention.backends import attention_mask_for, forward_kwargs
from onepass.batch import HOST, HostRows, host_rows, to_device
from onepass.model.couplings import logits_to_keep_for
from onepass.head import (
    add_logit_stats,
    chunked_lm_head_loss,
    head_as_identity,
    head_mode,
    head_of,
    weighted_ce,
)
from onepass.mixers.tree import chains_for
from onepass.layout.tree import IGNORE, ROW_SCHEMA, Layout
from onepass.parallel.comm import SequenceShard
from onepass.parallel.forward import ForwardPlan
from onepass.layout.view import View


def layouts_to_batch(layouts: Sequence[Layout], *, device: torch.device | str = "cpu",
                     length: int | None = None) -> dict[str, Any]:
    """Stack rows into [B, L] tensors; shorter rows are padded with self-only, untrained positions
    (to ``length`` when given, at least the longest row). The numpy rows stay beside them as
    ``batch[HOST]`` (:class:`onepass.batch.HostRows`): masks, chains and target positions are planned
    from those, never read back from the device; the tensors are copied without waiting (:func:`to_device`)."""
    length = max([len(x) for x in layouts] + [length or 0])
    batch: dict[str, list[np.ndarray]] = {k: [] for k in ROW_SCHEMA}
    for x in layouts:
        pad = length - len(x)
        batch["input_ids"].append(np.pad(x.input_ids, (0, pad)))
        batch["position_ids"].append(np.pad(x.position_ids, (0, pad)))
        batch["kv_end"].append(np.concatenate([x.kv_end, np.arange(len(x), length) + 1]))
        batch["targets"].append(np.pad(x.targets, (0, pad), constant_values=IGNORE))
        batch["weights"].append(np.pad(x.weights, (0, pad)))
    stacked = {k: np.stack(v).astype(ROW_SCHEMA[k], copy=False) for k, v in batch.items()}
    out: dict[str, Any] = {k: to_device(v, device) for k, v in stacked.items()}
    out[HOST] = HostRows.of(kv_end_BL=stacked["kv_end"], position_ids_BL=stacked["position_ids"],
                            targets_BL=stacked["targets"], weights_BL=stacked["weights"],
                            row_tokens_B=np.array([len(x) for x in layouts], dtype=np.int64))
    return out


class ForwardView:
    """What :func:`batch_loss` needs of a model: the wrapped forward (DDP, DeepSpeed, autocast)
    with the unwrapped model's ``config`` and ``dtype`` (the mask depends on them)."""

    def __init__(self, wrapped: Any, unwrapped: Any) -> None:
        self._wrapped = wrapped
        self.config = unwrapped.config
        self.dtype = unwrapped.dtype

        self.get_output_embeddings = unwrapped.get_output_embeddings  # the LM head (onepass.head)

    def __call__(self, **kwargs: Any) -> Any:
        return self._wrapped(**kwargs)


def batch_loss(model: Any, batch: Mapping[str, torch.Tensor], *, lm_head: str | None = None,
               stats: dict[str, torch.Tensor] | None = None, shard: SequenceShard | None = None) -> torch.Tensor:
    """Weighted-sum loss of a batch of rows (no normalisation: the caller divides).

    ``lm_head``: ``chunked`` (the default: :mod:`onepass.head`, never [T, V] logits),
    ``plain`` (the model's own head on the kept positions, then :func:`weighted_ce`)
    or ``cce``; unset, ``$ONEPASS_LM_HEAD`` decides (see :func:`forward_at_targets`). ``stats``: a
    dict the target weight, argmax-correct weight and weighted entropy are added to
    (:func:`onepass.head.add_logit_stats`; TRL's ``mean_token_accuracy`` and ``entropy``).
    ``shard``: sequence parallelism (:mod:`onepass.parallel`); every rank of the group passes the
    same whole rows and gets the loss sum of its shard's targets (the sums add up to the rows').
    """
    mode = head_mode(lm_head)
    out, head, targets_T, weights_T, autocast = forward_at_targets(model, batch, lm_head=mode, shard=shard)
    if head is None:
        if stats is not None:
            add_logit_stats(stats, out, targets_T.long(), weights_T)
        return weighted_ce(out, targets_T, weights_T)
    return chunked_lm_head_loss(out, head, targets_T, weights_T, mode=mode, stats=stats, autocast=autocast)


def row_losses(model: Any, batch: Mapping[str, torch.Tensor], *, lm_head: str | None = None,
               stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`batch_loss` per row (``[B]``, summing to it): one forward, the LM head row by row.

    For a mean over rows that must count each row once, whatever the batches (an evaluation whose
    processes pad their last batch with rows counted already: the pairs (row loss, row weight) are
    gathered and the duplicates dropped by the row)."""
    mode = head_mode(lm_head)
    out, head, targets_T, weights_T, autocast = forward_at_targets(model, batch, lm_head=mode)
    ends = host_rows(batch).row_ends.tolist()  # targets are kept row-major
    parts = []
    for start, end in zip([0, *ends[:-1]], ends):
        if head is None:
            if stats is not None:
                add_logit_stats(stats, out[start:end], targets_T[start:end].long(), weights_T[start:end])
            parts.append(weighted_ce(out[start:end], targets_T[start:end], weights_T[start:end]))
        else:
            parts.append(chunked_lm_head_loss(out[start:end], head, targets_T[start:end], weights_T[start:end],
                                              mode=mode, stats=stats, autocast=autocast))
    return torch.stack(parts) if parts else out.new_zeros(0)


def batch_dft_loss(model: Any, batch: Mapping[str, torch.Tensor], *,
                   stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Weighted-sum Dynamic Fine-Tuning loss of a batch of rows (TRL's ``loss_type='dft'``): each target's
    cross entropy times its own probability, detached. Exact on a tree: views that share a target share
    its context, so its probability, and their weights add as their N-pass terms would. Logits are formed
    at the targets only (the plain head)."""
    logits_TV, _, targets_T, weights_T, _ = forward_at_targets(model, batch, lm_head="plain")
    if stats is not None:
        add_logit_stats(stats, logits_TV, targets_T.long(), weights_T)
    return dft_sum(logits_TV, targets_T, weights_T)


def dft_sum(logits_TV: torch.Tensor, targets_T: torch.Tensor, weights_T: torch.Tensor) -> torch.Tensor:
    """Sum of ``-log p * p.detach() * weight`` over the targets (half-precision logits upcast to float32)."""
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    logp_T = torch.log_softmax(logits_TV, dim=-1).gather(1, targets_T.long()[:, None])[:, 0]
    return (-logp_T * logp_T.exp().detach() * weights_T.to(logp_T.dtype)).sum()


class AtTargets(NamedTuple):
    """:func:`forward_at_targets`' result: the model's output at the targets, with what the head needs."""

    out: torch.Tensor  # [T, D] hidden states with the head still to apply, or [T, V] logits (head None)
    head: nn.Module | None
    targets_T: torch.Tensor
    weights_T: torch.Tensor
    autocast: torch.dtype | None  # the autocast dtype the model's forward ran under, for the head's dtype rule


def forward_at_targets(model: Any, batch: Mapping[str, Any], *, lm_head: str | None = None,
                       shard: SequenceShard | None = None) -> AtTargets:
    """The model's output at the target positions (row-major), their targets and weights.

    Returns ``(hidden_TD, head, ...)`` with the LM head still to apply, or ``(logits_TV, None, ...)``
    on the plain path. Unless ``lm_head`` is ``plain``, the model runs with its head made an
    identity, so the forward still goes through every wrapper (DDP, autocast, peft) and the
    caller projects in chunks (:mod:`onepass.head`); a model that changes what its head
    returns (softcapping, scaling) is detected and takes the plain path. With a ``shard``, the
    targets are those of this rank's positions (:func:`_forward_kept`).

    Nothing here waits for the device (after a model's first call, which checks its head once):
    the mask, the chains and the target positions come from the batch's host rows
    (:mod:`onepass.batch`); the identity head returns every position and the targets' are gathered
    by index. The one exception is the plain head on several rows, which hands the model a
    per-row boolean mask (its own ``logits_to_keep`` indexing reads it).
    """
    mode = head_mode(lm_head)
    head = None if mode == "plain" else head_of(model)
    if head is not None and not getattr(head, _PLAIN_MARK, False):
        with head_as_identity(head) as seen:
            out_TD, targets_T, weights_T = _forward_kept(model, batch, shard, every_position=True)
        given = seen.hidden
        if getattr(head, _CHECKED_MARK, False) and len(given) == 1:  # checked once per model: no sync per step
            hidden_TD = out_TD if out_TD.dtype == given[0].dtype else given[0].reshape(out_TD.shape)
        else:
            hidden_TD = _returned_unchanged(out_TD, given)
        if hidden_TD is not None:
            setattr(head, _CHECKED_MARK, True)
            return AtTargets(hidden_TD.index_select(0, targets_T.index), head, targets_T.values, weights_T,
                             seen.autocast)
        setattr(head, _PLAIN_MARK, True)
        warnings.warn(f"onepass: {type(model).__name__} changes what its LM head returns; "
                      "using the plain LM head (full logits at the targets)", stacklevel=3)
    logits_TV, targets_T, weights_T = _forward_kept(model, batch, shard)
    return AtTargets(logits_TV, None, targets_T.values, weights_T, None)


_PLAIN_MARK, _CHECKED_MARK = "_onepass_head_plain", "_onepass_head_checked"


def _returned_unchanged(out_TD: torch.Tensor, seen: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The hidden states to project if the model returned what its (identity) head was given, else None.

    Unchanged up to a copy (DDP): the returned tensor. Up to a half -> float32 upcast
    (NemotronH's ``lm_head(h).float()``): the given one, since projecting it and
    upcasting the logits is what the model's own path does.
    """
    if len(seen) != 1 or seen[0].numel() != out_TD.numel():
        return None
    given = seen[0].reshape(out_TD.shape)
    if given.dtype == out_TD.dtype:
        return out_TD if torch.equal(given, out_TD) else None
    upcast = given.dtype in (torch.float16, torch.bfloat16) and out_TD.dtype == torch.float32
    return given if upcast and torch.equal(given.float(), out_TD) else None


class _Targets(NamedTuple):
    values: torch.Tensor  # [T] the target ids
    index: torch.Tensor  # [T] their flat positions in the rows this rank's forward returned ([B * L] based)


def _forward_kept(model: Any, batch: Mapping[str, Any], shard: SequenceShard | None = None, *,
                  every_position: bool = False) -> tuple[torch.Tensor, _Targets, torch.Tensor]:
    """The model's output ([T, V] logits, or with ``every_position`` the [B * L, D] output of an identity
    head, the caller gathering the targets' by ``index``), the targets and their weights.

    The target positions are the host rows' (:class:`onepass.batch.HostRows`), sent to the device without
    waiting; the targets and weights are gathered there by index (no boolean index, no ``nonzero``).
    With a ``shard`` (sequence parallelism) the rows are padded to a multiple of the degree; the
    mask, the chains, ``kv_end`` and the position ids stay those of the whole rows (global: nothing
    is re-based), the model holds this rank's positions (:meth:`SequenceShard.local`) and returns
    its targets. A target is already shifted (the next token of its own position), so no shard
    needs its neighbour's tokens.
    """
    host = host_rows(batch)
    if shard is not None:
        batch = pad_batch(batch, shard.degree)
        host = host.padded(shard.degree)
    plan = forward_plan(model, batch, host=host, shard=shard)
    held = {k: batch[k] if shard is None else shard.local(batch[k])
            for k in ("input_ids", "position_ids", "targets", "weights")}
    mine = host if shard is None else host.local(shard.degree, shard.rank)
    device = held["targets"].device
    index_T = to_device(mine.keep_T, device)
    targets_T = held["targets"].reshape(-1).index_select(0, index_T)
    weights_T = held["weights"].reshape(-1).index_select(0, index_T)
    pick_T = None
    if every_position:
        keep: Any = 0  # every position: the identity head's output is the hidden states, gathered by index after
    else:  # one row's positions, a [B, L] mask per row (5.23 on), or the rows' union and each row's own after
        keep_host, pick_host = logits_to_keep_for(model, mine.targets_BL != IGNORE)
        keep = to_device(keep_host, device)
        pick_T = None if pick_host is None else to_device(pick_host, device)
    out = model(input_ids=held["input_ids"], position_ids=held["position_ids"],
                logits_to_keep=keep, use_cache=False, **plan.model_kwargs())
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    return (logits if pick_T is None else logits.index_select(0, pick_T)), _Targets(targets_T, index_T), weights_T


def forward_plan(model: Any, batch: Mapping[str, Any], *, host: HostRows | None = None,
                 shard: SequenceShard | None = None) -> ForwardPlan:
    """The forward's one record for ``batch`` (:class:`onepass.parallel.forward.ForwardPlan`): the tree mask
    of ``model``'s backend, the rows' chains (its recurrent mixers installed to read them), ``shard`` and the
    backend's options, planned once from the host rows (``host``: the batch's, when the caller has them).
    Under sequence parallelism ``batch`` is the whole rows padded to a multiple of the degree
    (:func:`pad_batch`): the mask and the chains are the whole rows', whatever each rank holds."""
    host = host_rows(batch) if host is None else host
    mask = attention_mask_for(model, batch["kv_end"], position_ids_BL=batch["position_ids"],
                              host_kv_end=host.kv_end_BL, host_position_ids=host.position_ids_BL)
    chains = chains_for(model, host.kv_end_BL)  # recurrent layers scan the tree chain by chain
    return ForwardPlan(mask=mask, chains=chains, shard=shard, options=forward_kwargs(model))


def pad_batch(batch: Mapping[str, Any], multiple: int) -> dict[str, Any]:
    """``batch`` with its rows padded to a multiple of ``multiple`` positions, as :func:`layouts_to_batch`
    pads (a pad sees only itself, trains nothing); its host rows too."""
    B, L = batch["kv_end"].shape
    pad = -L % multiple
    if not pad:
        return dict(batch)
    kv_end = batch["kv_end"]
    tail = torch.arange(L + 1, L + pad + 1, dtype=kv_end.dtype, device=kv_end.device).expand(B, pad)
    fill = {"targets": IGNORE}
    padded = {k: (torch.cat([v, tail], 1) if k == "kv_end" else
                  torch.nn.functional.pad(v, (0, pad), value=fill.get(k, 0)) if k in ROW_SCHEMA else v)
              for k, v in batch.items()}
    if HOST in batch:
        padded[HOST] = host_rows(batch).padded(multiple)
    return padded


def layout_loss(model: Any, layout: Layout) -> torch.Tensor:
    """Weighted-sum loss of one row."""
    device = next(model.parameters()).device
    return batch_loss(model, layouts_to_batch([layout], device=device))


def view_loss_reference(model: Any, view: View, weight: float = 1.0) -> torch.Tensor:
    """The N-pass loss of one view: plain HF forward, full logits, standard shift.

    No position ids, no mask, nothing from onepass's layout: this is what the
    one-pass loss is checked against (with flex_attention, the same kernel choice as the one-pass
    forward: :func:`~onepass.attention.backends.forward_kwargs`).
    """
    device = next(model.parameters()).device
    ids_1N = torch.as_tensor(view.tokens, device=device).long()[None]
    logits_NV = model(input_ids=ids_1N, use_cache=False, **forward_kwargs(model)).logits[0]
    first = max(view.num_prompt, 1)
    pred_TV = logits_NV[first - 1:-1]
    target_T = ids_1N[0, first:]
    if pred_TV.dtype in (torch.float16, torch.bfloat16):
        pred_TV = pred_TV.float()
    return F.cross_entropy(pred_TV, target_T, reduction="sum") * weight
