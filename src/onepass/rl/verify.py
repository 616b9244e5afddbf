"""Measured equivalence for RL: one-pass per-token log-probs and policy-loss gradients vs per-turn forwards.

Why this module exists: the promise of :mod:`onepass.rl` is that scoring a group's
turns from its prefix tree gives the log-prob of every sampled token, and the
gradient of the policy loss, that a separate forward per turn gives. This checks
it on the user's rollouts and model (``onepass verify --rollouts``): per-turn
references (:func:`onepass.rl.losses.policy_loss_reference`), then the rows
(:func:`onepass.rl.losses.policy_loss`), every log-prob, entropy and parameter
gradient compared.

The loss checked is the one the rollouts support: the clipped surrogate with
DAPO's clip-higher, token normalisation and, where every turn carries the
sampler's log-probs, those as the old policy (so clipping is active), truncated
importance sampling and a KL term against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from onepass.verify.divergence import Verdict, judge, locate, max_rel_grad_diff, nan_max, trains_nothing
from onepass.rl.layout import layout_rollouts, turn_view
from onepass.rl.logprobs import token_logprobs, token_logprobs_reference
from onepass.rl.losses import PolicyLossConfig, policy_loss, policy_loss_reference
from onepass.rl.rollouts import RolloutError, Trajectory
from onepass.verify.check import parameter_grads
from onepass.layout.vocab import remap, used_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class RLVerifyReport:
    equal: bool
    max_abs_logprob_diff: float
    max_abs_entropy_diff: float
    rel_loss_diff: float
    max_rel_grad_diff: float
    token_ratio: float  # per-turn tokens / one-pass tokens
    per_turn_tokens: int
    one_pass_tokens: int
    num_trajectories: int
    num_turns: int
    num_completion_tokens: int
    num_rows: int
    num_trees: int
    loss: str
    tolerance: float
    dtype: str
    worst_parameter: str = ""
    verdict: Verdict | None = None  # how ``equal`` was judged (onepass.verify.divergence.judge), and where they part

    def to_dict(self) -> dict[str, Any]:
        flat = {k: v for k, v in asdict(self).items() if k != "verdict"}
        return {**flat, **(self.verdict.to_dict() if self.verdict is not None else {})}


def compact_rollouts(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """Token ids renumbered to 0..V-1 (the ids that occur; :mod:`onepass.layout.vocab`), for a tiny random model."""
    used = used_ids(a for traj in trajectories for t in traj.turns for a in (t.prompt_ids, t.completion_ids))
    out = [replace(traj, turns=tuple(replace(t, prompt_ids=remap(t.prompt_ids, used),
                                             completion_ids=remap(t.completion_ids, used)) for t in traj.turns))
           for traj in trajectories]
    return out, len(used)


def verify_loss_config(trajectories: Sequence[Trajectory]) -> tuple[PolicyLossConfig, Any]:
    """The loss :func:`run_rl_verify` checks, and the per-turn log-probs it uses as old policy and reference."""
    sampled = all(t.logprobs is not None for traj in trajectories for t in traj.turns)
    if not sampled:
        return PolicyLossConfig(clip_high=0.28), None
    old = [[t.logprobs for t in traj.turns] for traj in trajectories]
    return PolicyLossConfig(clip_high=0.28, tis_cap=2.0, kl_coef=0.1), old


def run_rl_verify(trajectories: Sequence[Trajectory], model: Any, *, max_tokens: int | None = None,
                  tolerance: float = 1e-9) -> RLVerifyReport:
    """One-pass vs per-turn log-probs, entropies, loss and gradients; ``equal`` within ``tolerance``
    (absolute for log-probs and entropies, relative for the loss and every parameter's gradient)."""
    trajectories = list(trajectories)
    if not trajectories or not any(len(t.completion_ids) for traj in trajectories for t in traj.turns):
        raise RolloutError("verify --rollouts checked nothing: no completion token to score (a verdict on nothing "
                           "is no verdict)")
    batch = layout_rollouts(trajectories, max_tokens=max_tokens)
    config, old = verify_loss_config(trajectories)
    kw = dict(old=old, ref=old)

    model.zero_grad(set_to_none=True)
    ref = policy_loss_reference(model, trajectories, config, backward=True, **kw)
    grads_ref = parameter_grads(model)
    if trains_nothing(grads_ref):
        raise RolloutError(f"verify --rollouts checked nothing: nothing is trained ({_why_untrained(trajectories)}: "
                           "the per-turn loss has no gradient), so both sides' zero gradients agree on nothing (a "
                           "verdict on nothing is no verdict)")
    model.zero_grad(set_to_none=True)
    got = policy_loss(model, batch, config, backward=True, **kw)
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ent_ref = token_logprobs_reference(model, trajectories, entropy=True)
        ent = token_logprobs(model, batch, entropy=True)

    def max_abs(a: Any, b: Any) -> float:
        return nan_max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys) if len(x))

    lp_diff = nan_max((max_abs(got.logprobs.logprobs, ref.logprobs.logprobs), max_abs(ent.logprobs, ent_ref.logprobs)))
    ent_diff = max_abs(ent.entropy, ent_ref.entropy)
    loss_ref, loss = ref.loss.item(), got.loss.item()
    rel_loss = abs(loss - loss_ref) / abs(loss_ref) if loss_ref else abs(loss)
    rel_grad, worst = max_rel_grad_diff(grads_ref, grads)
    verdict = judge(nan_max((lp_diff, ent_diff, rel_loss)), rel_grad, tolerance=tolerance,
                    where=lambda: locate(model, _turn_views_by_group(trajectories), worst_parameter=worst,
                                         tolerance=tolerance))
    what = f"clipped surrogate (clip 0.2/0.28, token-normalised{', TIS 2, KL 0.1 vs sampler' if old else ''})"
    return RLVerifyReport(
        equal=verdict.equal, verdict=verdict, max_abs_logprob_diff=lp_diff, max_abs_entropy_diff=ent_diff, rel_loss_diff=rel_loss,
        max_rel_grad_diff=rel_grad, token_ratio=batch.per_turn_tokens / batch.one_pass_tokens,
        per_turn_tokens=batch.per_turn_tokens, one_pass_tokens=batch.one_pass_tokens,
        num_trajectories=len(trajectories), num_turns=sum(len(t.turns) for t in trajectories),
        num_completion_tokens=batch.num_completion_tokens, num_rows=len(batch.rows), num_trees=batch.num_trees,
        loss=what, tolerance=tolerance, dtype=str(next(model.parameters()).dtype), worst_parameter=worst)


def _why_untrained(trajectories: Sequence[Trajectory]) -> str:
    """Why the per-turn loss of ``trajectories`` has no gradient, as the rollouts show it."""
    turns = [t for traj in trajectories for t in traj.turns]
    if not any(t.mask.any() for t in turns):
        return f"every completion token of the {len(turns)} turns has mask 0"
    if not any(bool((t.advantages * t.mask).any()) for t in turns):
        return "every trained token's advantage is 0"
    return "every gradient of the per-turn loss is 0"


def _turn_views_by_group(trajectories: Sequence[Trajectory]) -> list[list[Any]]:
    """Every turn's view, grouped as the trees are (one group's turns share a tree), for locating a difference."""
    groups: dict[str, list[Any]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group, []).extend(turn_view(traj, k) for k in range(len(traj.turns)))
    return list(groups.values())
