"""Per-token log-probs of every completion token of every turn, from one forward per row.

Why this module exists: every policy-gradient loss (GRPO, DAPO, PPO, KL to a
reference, on-policy distillation) is a function of the log-prob of each sampled
token under the policy. Per turn that is one forward of ``prompt_ids +
completion_ids``; here it is one forward per row of the group's prefix tree
(:mod:`onepass.rl.layout`), with the tree mask, recurrent layers scanned chain by
chain and the LM head applied in chunks (:func:`onepass.loss.forward_at_targets`,
:func:`onepass.head.chunked_token_logprobs`), then gathered back per turn. A node
two turns share (the same ancestors, the same next token) is computed once and
its gradient is the sum of its users', as the per-turn backward would sum them.

``temperature``: the log-probs of the distribution the sampler drew from, ``softmax(logits / T)``
(as SkyRL and verl score a rollout sampled at temperature T); 1 is the model's own.

:func:`token_logprobs_reference` is the slow, obviously-correct version: one plain HF
forward per turn, no position ids, no mask, full logits, the usual shift.

Legend: T targets of a row, C completion tokens of a turn, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.attention.backends import forward_kwargs
from onepass.head import chunked_token_logprobs, logprobs_from_logits
from onepass.loss import forward_at_targets, layouts_to_batch, pad_batch
from onepass.rl.layout import RolloutBatch
from onepass.rl.rollouts import Trajectory
from onepass.layout.row_check import check_rows, model_vocab
from onepass.layout.tree import IGNORE
from onepass.parallel.comm import SequenceShard

PerTurn = tuple[tuple[torch.Tensor, ...], ...]  # [trajectory][turn] -> [C]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprobs:
    """``logprobs[i][k][j]``: log-prob of completion token j of turn k of trajectory i (and its entropy)."""

    logprobs: PerTurn
    entropy: PerTurn | None = None

    def detach(self) -> TokenLogprobs:
        def d(x: PerTurn | None) -> PerTurn | None:
            return None if x is None else tuple(tuple(t.detach() for t in turns) for turns in x)
        return TokenLogprobs(logprobs=d(self.logprobs), entropy=d(self.entropy))  # type: ignore[arg-type]

    def flat(self) -> torch.Tensor:
        """All log-probs in trajectory, turn, token order."""
        parts = [t for turns in self.logprobs for t in turns]
        return torch.cat(parts) if parts else torch.zeros(0)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


class _Tempered(torch.nn.Module):
    """An LM head whose logits are divided by the sampling temperature (its parameters are the head's)."""

    def __init__(self, head: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.head, self.temperature = head, temperature

    def forward(self, hidden_CD: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_CD) / self.temperature


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def row_logprobs(model: Any, batch: RolloutBatch, row: int, *, entropy: bool = False, lm_head: str | None = None,
                 shard: SequenceShard | None = None, temperature: float = 1.0
                 ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """One forward of ``batch.rows[row]``; yields ``(trajectory, turn, logprobs_C, entropy_C)`` of its turns.

    ``shard``: the row split over a sequence-parallel group (:mod:`onepass.parallel`); each rank scores its
    shard's targets and every rank gets them all back (an all-gather), so the turns come out whole.

    The row is checked first, as every row that reaches a model is (:func:`onepass.layout.row_check.check_rows`:
    ids within the model's vocabulary, ``kv_end`` the tree of ``position_ids``): one line naming the row,
    not a raw ``IndexError`` (or a device-side assert on CUDA) deep in the forward.
    """
    _check_temperature(temperature)
    layout = batch.rows[row]
    check_rows([layout], vocab_size=model_vocab(model), source="rollout batch", require_weight=False, start=row,
               hint="the rollouts' token ids must be ids of this model's vocabulary")
    rows = layouts_to_batch([layout], device=_device(model))
    out, head, targets_T, _, autocast = forward_at_targets(model, rows, lm_head=lm_head, shard=shard)
    if head is None:
        lp_T, ent_T = logprobs_from_logits(out if temperature == 1 else out / temperature, targets_T, entropy=entropy)
    else:
        head = head if temperature == 1 else _Tempered(head, temperature)
        lp_T, ent_T = chunked_token_logprobs(out, head, targets_T, entropy=entropy, autocast=autocast)
    if shard is not None:  # this rank's targets -> the row's, in row order
        kept_BL = pad_batch(rows, shard.degree)["targets"] != IGNORE
        counts = [int(c.sum()) for c in kept_BL.chunk(shard.degree, dim=1)]
        lp_T = shard.gather_targets(lp_T, counts)
        ent_T = None if ent_T is None else shard.gather_targets(ent_T, counts)
    kept = np.cumsum(layout.targets != IGNORE) - 1  # row position -> index among the row's targets
    for i, k in batch.turns_in_row(row):
        index = torch.as_tensor(kept[batch.slots[i][k].positions], device=lp_T.device)
        yield i, k, lp_T[index], (None if ent_T is None else ent_T[index])


def token_logprobs(model: Any, batch: RolloutBatch, *, entropy: bool = False, lm_head: str | None = None,
                   shard: SequenceShard | None = None, temperature: float = 1.0) -> TokenLogprobs:
    """Log-prob (and entropy) of every completion token, one forward per row; differentiable.

    Equal to :func:`token_logprobs_reference` (float64: to rounding). All rows' graphs stay
    alive until the caller's backward; to train on more rows than fit, use
    :func:`onepass.rl.losses.policy_loss` with ``backward=True`` (row by row). ``shard``: every row
    split over a sequence-parallel group, every rank getting every log-prob; a loss computed from
    them is then the same on each of the group's S ranks, so divide it by S before a backward whose
    gradients are summed over them.
    """
    lps: list[list[Any]] = [[None] * len(t.turns) for t in batch.trajectories]
    ents: list[list[Any]] = [[None] * len(t.turns) for t in batch.trajectories]
    for row in range(len(batch.rows)):
        for i, k, lp, ent in row_logprobs(model, batch, row, entropy=entropy, lm_head=lm_head, shard=shard,
                                          temperature=temperature):
            lps[i][k], ents[i][k] = lp, ent
    return TokenLogprobs(logprobs=tuple(map(tuple, lps)), entropy=tuple(map(tuple, ents)) if entropy else None)


def turn_logprobs_reference(model: Any, trajectory: Trajectory, k: int, *, entropy: bool = False,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One turn alone: a plain forward of ``prompt_ids + completion_ids``, full logits / temperature, the usual
    shift."""
    t = trajectory.turns[k]
    ids_1N = torch.as_tensor(np.concatenate([t.prompt_ids, t.completion_ids]), device=_device(model))[None]
    logits_NV = model(input_ids=ids_1N, use_cache=False, **forward_kwargs(model)).logits[0]
    p = len(t.prompt_ids)
    return logprobs_from_logits(logits_NV[p - 1:-1] / temperature, ids_1N[0, p:], entropy=entropy)


def token_logprobs_reference(model: Any, trajectories: tuple[Trajectory, ...] | list[Trajectory], *,
                             entropy: bool = False, temperature: float = 1.0) -> TokenLogprobs:
    """Slow reference of :func:`token_logprobs`: one plain forward per turn."""
    lps, ents = [], []
    for traj in trajectories:
        pairs = [turn_logprobs_reference(model, traj, k, entropy=entropy, temperature=temperature)
                 for k in range(len(traj.turns))]
        lps.append(tuple(lp for lp, _ in pairs))
        ents.append(tuple(e for _, e in pairs))
    return TokenLogprobs(logprobs=tuple(lps), entropy=tuple(ents) if entropy else None)  # type: ignore[arg-type]
