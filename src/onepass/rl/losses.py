"""Policy losses on per-token log-probs: clipped surrogate, KL, truncated IS, reverse-KL distillation.

Why this module exists: every loss here is a sum over completion tokens of a
per-token term times a static weight (the normalisation), so it decomposes over
turns and over rows: computing the log-probs from the one-pass rows
(:mod:`onepass.rl.logprobs`) instead of per-turn forwards changes nothing but the
cost, and the gradient is the per-turn gradient. Per token, with ``lp`` the
policy's log-prob, ``old`` the log-prob when the batch was sampled (default: ``lp``
detached, i.e. one on-policy step), ``A`` the advantage::

    r      = exp(lp - old)
    pg     = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)      GRPO / DAPO (clip_high 0.28)
    pg    *= min(exp(old - sampler), tis_cap)                        truncated IS vs the sampler's log-probs
    kl     = exp(ref - lp) - (ref - lp) - 1                          k3 estimator of KL(policy || ref)
    dist   = sg(lp - teacher) * r                                    reverse KL to a teacher (sampled, on-policy)
    term   = pg + kl_coef kl + distill_coef dist

``dist``'s gradient is ``(lp - teacher) grad lp``, the score-function gradient of the
per-token reverse KL E_policy[log policy - log teacher]. Weights (``mask`` 0 tokens get 0):

    token        1 / trained tokens of the batch                     DAPO
    sequence     1 / (turns x trained tokens of the turn)            GRPO (each turn a sequence)
    trajectory   1 / (trajectories x trained tokens of the trajectory)
    constant     1 / constant                                        Dr.GRPO (e.g. turns x max length)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.errors import ConfigError
from onepass.rl.layout import RolloutBatch
from onepass.rl.logprobs import PerTurn, TokenLogprobs, row_logprobs, turn_logprobs_reference
from onepass.rl.rollouts import RolloutError, Trajectory

NORMALIZATIONS = ("token", "sequence", "trajectory", "constant")
PerTurnValues = Sequence[Sequence[Any]]  # [trajectory][turn] -> [C] tensor or array


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO's clip-higher: 0.28
    normalize: str = "token"  # see NORMALIZATIONS and the module docstring
    constant: float | None = None  # the divisor of normalize="constant"
    kl_coef: float = 0.0  # needs ref log-probs
    tis_cap: float | None = None  # needs the sampler's log-probs in every turn
    distill_coef: float = 0.0  # needs teacher log-probs

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "distill_coef", "constant", "tis_cap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number, got {value!r} (NaN would train as NaN)")
        if self.kl_coef < 0 or self.distill_coef < 0:
            raise ConfigError(f"kl_coef and distill_coef must be >= 0 (a penalty, not a reward), got "
                              f"{self.kl_coef}, {self.distill_coef}")
        if self.normalize not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalize {self.normalize!r}; use one of {', '.join(NORMALIZATIONS)}")
        if self.normalize == "constant" and not (self.constant and self.constant > 0):
            raise ConfigError("normalize='constant' needs constant > 0 (Dr.GRPO: e.g. turns x max completion length)")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ConfigError(f"clip_low and clip_high must be >= 0, got {self.clip_low}, {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"tis_cap must be > 0, got {self.tis_cap}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLoss:
    loss: torch.Tensor  # scalar; detached when the backward already ran
    logprobs: TokenLogprobs  # detached when the backward already ran
    clip_fraction: float  # trained tokens whose ratio was clipped


def token_weights(trajectories: Sequence[Trajectory], config: PolicyLossConfig) -> list[list[np.ndarray]]:
    """The static weight of every completion token (0 where ``mask`` is 0); see the module docstring."""
    masks = [[t.mask for t in traj.turns] for traj in trajectories]
    if config.normalize == "token":
        total = sum(m.sum() for turns in masks for m in turns)
        return [[m / max(total, 1.0) for m in turns] for turns in masks]
    if config.normalize == "sequence":
        n = sum(len(turns) for turns in masks)
        return [[m / (n * max(m.sum(), 1.0)) for m in turns] for turns in masks]
    if config.normalize == "trajectory":
        return [[m / (len(masks) * max(sum(x.sum() for x in turns), 1.0)) for m in turns] for turns in masks]
    return [[m / config.constant for m in turns] for turns in masks]


def token_loss(lp: torch.Tensor, *, advantages: torch.Tensor, old: torch.Tensor, config: PolicyLossConfig,
               sampler: torch.Tensor | None = None, ref: torch.Tensor | None = None,
               teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token term of the module docstring, and which tokens were clipped."""
    ratio = torch.exp(lp - old)
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    surrogate, surrogate_clipped = ratio * advantages, clipped * advantages
    term = -torch.minimum(surrogate, surrogate_clipped)
    if config.tis_cap is not None:
        term = term * torch.clamp(torch.exp(old - sampler), max=config.tis_cap).detach()
    if config.kl_coef:
        d = ref - lp
        term = term + config.kl_coef * (torch.exp(d) - d - 1)
    if config.distill_coef:
        term = term + config.distill_coef * (lp - teacher).detach() * ratio
    return term, surrogate_clipped < surrogate


def _check_per_turn(values: PerTurnValues | None, name: str, trajectories: Sequence[Trajectory]) -> None:
    """``values`` (old / ref / teacher log-probs) hold one finite value per completion token of every turn:
    a wrong length would broadcast (a 1-value ``old`` applied to every token), a NaN would train as NaN."""
    if values is None:
        return
    if len(values) != len(trajectories):
        raise RolloutError(f"{name} has {len(values)} trajectories, the batch {len(trajectories)}")
    tensors = []
    for traj, turns in zip(trajectories, values):
        if len(turns) != len(traj.turns):
            raise RolloutError(f"{traj.at()}: {name} has {len(turns)} turns, the trajectory {len(traj.turns)}")
        for k, (t, v) in enumerate(zip(traj.turns, turns)):
            v = torch.as_tensor(v).detach()
            if tuple(v.shape) != (len(t.completion_ids),):
                raise RolloutError(f"{traj.at(k)}: {name} has shape {tuple(v.shape)} for "
                                   f"{len(t.completion_ids)} completion tokens (one value per token)")
            tensors.append((traj, k, v))
    if not tensors:
        return
    device = tensors[0][2].device
    if bool(torch.isfinite(torch.cat([v.to(device, torch.float64) for _, _, v in tensors])).all()):  # one sync
        return
    traj, k, v = next(item for item in tensors if not bool(torch.isfinite(item[2]).all()))
    j = int((~torch.isfinite(v)).nonzero()[0])
    raise RolloutError(f"{traj.at(k)}: {name}[{j}] = {float(v[j])!r} is not finite (a log-prob is a finite number)")


def _check_turns(trajectories: Sequence[Trajectory]) -> None:
    """Advantages and the sampler's log-probs are finite (the reader checks them; a Turn built in Python is not read)."""
    for traj in trajectories:
        for k, t in enumerate(traj.turns):
            for what, x in (("advantages", t.advantages), ("logprobs", t.logprobs), ("mask", t.mask)):
                if x is not None and (len(x) != len(t.completion_ids) or not np.isfinite(x).all()):
                    raise RolloutError(f"{traj.at(k)}: {what} must hold {len(t.completion_ids)} finite values "
                                       f"(one per completion token), got {np.asarray(x)[:8].tolist()}")


def _check_inputs(trajectories: Sequence[Trajectory], config: PolicyLossConfig, ref: Any, teacher: Any,
                  old: Any = None) -> None:
    _check_turns(trajectories)
    for name, values in (("old", old), ("ref", ref), ("teacher", teacher)):
        _check_per_turn(values, name, trajectories)
    if config.kl_coef and ref is None:
        raise ConfigError("kl_coef > 0 needs ref log-probs (token_logprobs of the reference model on the same batch)")
    if config.distill_coef and teacher is None:
        raise ConfigError("distill_coef > 0 needs teacher log-probs (token_logprobs of the teacher on the same batch)")
    if config.tis_cap is not None:
        for traj in trajectories:
            for k, t in enumerate(traj.turns):
                if t.logprobs is None:
                    raise ConfigError(f"tis_cap needs the sampler's logprobs in every turn; {traj.at(k)} has none")


def _turn_loss(lp: torch.Tensor, traj: Trajectory, i: int, k: int, weights: list[list[np.ndarray]],
               config: PolicyLossConfig, old: PerTurnValues | None, ref: PerTurnValues | None,
               teacher: PerTurnValues | None) -> tuple[torch.Tensor, int]:
    """Weighted sum of turn (i, k)'s token terms, and its number of clipped trained tokens."""
    t = traj.turns[k]

    def tensor(x: Any) -> torch.Tensor:
        return torch.as_tensor(x, device=lp.device).to(lp.dtype)

    term, was_clipped = token_loss(
        lp, advantages=tensor(t.advantages), old=lp.detach() if old is None else tensor(old[i][k]).detach(),
        config=config, sampler=None if t.logprobs is None else tensor(t.logprobs),
        ref=None if ref is None else tensor(ref[i][k]).detach(),
        teacher=None if teacher is None else tensor(teacher[i][k]).detach())
    w = tensor(weights[i][k])
    return (term * w).sum(), int((was_clipped & (w > 0)).sum())


def policy_loss(model: Any, batch: RolloutBatch, config: PolicyLossConfig = PolicyLossConfig(), *,
                old: PerTurnValues | None = None, ref: PerTurnValues | None = None,
                teacher: PerTurnValues | None = None, backward: bool = False, lm_head: str | None = None
                ) -> PolicyLoss:
    """The policy loss of ``batch`` from one forward per row; equal to :func:`policy_loss_reference`.

    ``old`` / ``ref`` / ``teacher``: per trajectory and turn log-probs (e.g. ``token_logprobs(...)``
    of the old policy, the reference model, the teacher on the same batch, under ``no_grad``).
    ``backward``: run each row's backward right after its forward (activations of one row at a
    time; the loss is a sum over rows), and return detached values.
    """
    _check_inputs(batch.trajectories, config, ref, teacher, old)
    weights = token_weights(batch.trajectories, config)
    lps: list[list[Any]] = [[None] * len(t.turns) for t in batch.trajectories]
    total: torch.Tensor | float = 0.0
    clipped = 0
    for row in range(len(batch.rows)):
        row_total: torch.Tensor | float = 0.0
        for i, k, lp, _ in row_logprobs(model, batch, row, lm_head=lm_head):
            part, n = _turn_loss(lp, batch.trajectories[i], i, k, weights, config, old, ref, teacher)
            row_total, clipped = row_total + part, clipped + n
            lps[i][k] = lp.detach() if backward else lp
        if backward and isinstance(row_total, torch.Tensor):
            row_total.backward()
            row_total = row_total.detach()
        total = total + row_total
    return _result(total, lps, clipped, weights)


def policy_loss_reference(model: Any, trajectories: Sequence[Trajectory], config: PolicyLossConfig = PolicyLossConfig(),
                          *, old: PerTurnValues | None = None, ref: PerTurnValues | None = None,
                          teacher: PerTurnValues | None = None, backward: bool = False) -> PolicyLoss:
    """Slow reference of :func:`policy_loss`: one plain forward (and backward) per turn."""
    _check_inputs(trajectories, config, ref, teacher, old)
    weights = token_weights(trajectories, config)
    lps: list[list[Any]] = [[None] * len(t.turns) for t in trajectories]
    total: torch.Tensor | float = 0.0
    clipped = 0
    for i, traj in enumerate(trajectories):
        for k in range(len(traj.turns)):
            lp, _ = turn_logprobs_reference(model, traj, k)
            part, n = _turn_loss(lp, traj, i, k, weights, config, old, ref, teacher)
            if backward:
                part.backward()
                part, lp = part.detach(), lp.detach()
            total, clipped, lps[i][k] = total + part, clipped + n, lp
    return _result(total, lps, clipped, weights)


def _result(total: torch.Tensor | float, lps: list[list[Any]], clipped: int, weights: list[list[np.ndarray]]
            ) -> PolicyLoss:
    trained = sum(int((w > 0).sum()) for turns in weights for w in turns)
    loss = total if isinstance(total, torch.Tensor) else torch.zeros(())
    logprobs: PerTurn = tuple(tuple(turns) for turns in lps)
    return PolicyLoss(loss=loss, logprobs=TokenLogprobs(logprobs=logprobs), clip_fraction=clipped / max(trained, 1))
