"""Per-token log-probs for a padded batch (TRL's and SkyRL's layouts), computed from one-pass rows.

Why this module exists: RL trainers (TRL's ``GRPOTrainer``, and most others) hold a
batch as left-padded prompts next to right-padded completions and ask for a
[B, C] tensor of completion log-probs (``_get_per_token_logps_and_entropies`` in
TRL). When the batch holds the G samples of a prompt, or the turns of multi-turn
trajectories fed as separate samples (each turn its own prompt, earlier reasoning
dropped), its rows share long prefixes. This function is the drop-in for that
call: it unpads each row, merges all of them into one prefix tree
(:func:`onepass.rl.layout.layout_rollouts`, under a token budget), scores them with
:func:`onepass.rl.logprobs.token_logprobs` and scatters the log-probs back into
[B, C] (0 at padding). Gradients flow back through the scatter.

Example, B = 2 rows sharing the prompt ``h1 h2`` (``.`` is padding)::

    input_ids        . h1 h2 | a b .        one tree:  h1 h2 a b
                     h1 h2 h3 | c . .                   h1 h2 h3 c    (h1 h2 stored once)
    logits_to_keep = 3        -> logps [[lp(a), lp(b), 0], [lp(c), 0, 0]]

SkyRL holds each sample as one left-padded block whose response is right-aligned, and asks for
the log-probs of the last W = ``num_actions`` positions (``log_probs[:, -W - 1:-1]`` of the
shifted forward; a short response's window starts inside its prompt)::

    sequences        . . h1 h2 a b          window W = 3: the real tokens of the last 3 positions
                     . h1 h2 h3 c d         -> logps [[lp(h2), lp(a), lp(b)], [lp(h3), lp(c), lp(d)]]

:func:`window_token_logprobs` scores every real token of the window that has a real token before it
(0 elsewhere: padding, and a row's first token), as SkyRL's own forward does at those positions.

What is not covered: multimodal inputs and MoE auxiliary losses (the caller keeps its own path for those).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from onepass.rl.layout import layout_rollouts
from onepass.rl.logprobs import token_logprobs
from onepass.rl.rollouts import Trajectory, Turn


def padded_trajectories(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
                        ) -> list[Trajectory]:
    """Each row as a one-turn trajectory: the unpadded prompt, and the completion up to its last kept token."""
    ids = input_ids.detach().cpu().numpy()
    keep = attention_mask.detach().cpu().numpy().astype(bool)
    num_prompt = ids.shape[1] - logits_to_keep
    out = []
    for b in range(ids.shape[0]):
        prompt = ids[b, :num_prompt][keep[b, :num_prompt]]
        kept = np.flatnonzero(keep[b, num_prompt:])
        completion = ids[b, num_prompt:num_prompt + (int(kept[-1]) + 1 if len(kept) else 0)]
        n = len(completion)
        turn = Turn(prompt_ids=prompt.astype(np.int64), completion_ids=completion.astype(np.int64),
                    advantages=np.zeros(n), mask=np.ones(n))
        out.append(Trajectory(group="batch", turns=(turn,), source="padded batch", index=b, unit="row"))
    return out


def padded_token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                          *, entropy: bool = False, max_tokens: int | None = None, temperature: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, logits_to_keep] log-probs (and entropies) of the completion tokens, 0 past each row's last kept one.

    A batch that keeps no completion token at all (TRL's ``mask_truncated_completions`` on a batch whose
    completions were all truncated) still comes back connected to the model's graph, as TRL's own path does
    (its forward runs on every row, the mask zeroes the loss): each row's first completion token is scored
    and the result zeroed, so the loss is 0 with a zero gradient, not a backward through nothing ("element 0
    of tensors does not require grad")."""
    trajectories = padded_trajectories(input_ids, attention_mask, logits_to_keep)
    masked = (torch.is_grad_enabled() and logits_to_keep > 0
              and not any(len(t.turns[0].completion_ids) for t in trajectories))
    if masked:
        anchor = attention_mask.clone()
        anchor[:, -logits_to_keep] = 1  # every row's first sampled token (a completion has one at least)
        trajectories = padded_trajectories(input_ids, anchor, logits_to_keep)
    scored = token_logprobs(model, layout_rollouts(trajectories, max_tokens=max_tokens), entropy=entropy,
                            temperature=temperature)

    def scatter(per_turn: Any) -> torch.Tensor:
        parts = [turns[0] for turns in per_turn]
        dtype = next((p.dtype for p in parts if len(p)), torch.float32)
        out = torch.zeros(len(parts), logits_to_keep, dtype=dtype, device=input_ids.device)
        for b, part in enumerate(parts):
            out[b, :len(part)] = part.to(out.device)  # a differentiable copy into the padded tensor
        if masked:  # zeros that keep the graph (and a zero gradient, even where a log-prob is -inf)
            out = out.masked_fill(torch.ones_like(out, dtype=torch.bool), 0.0)
        return out

    return scatter(scored.logprobs), (scatter(scored.entropy) if entropy else None)


def window_trajectories(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int
                        ) -> list[Trajectory | None]:
    """Each row of SkyRL's layout (one left-padded block per row) as a one-turn trajectory whose completion is the
    real tokens of the last ``num_actions`` positions that follow a real token, and whose prompt is the rest; None
    for a row with fewer than two real tokens (nothing to score)."""
    ids = sequences.detach().cpu().numpy()
    keep = attention_mask.detach().cpu().numpy().astype(bool)
    if not 0 < num_actions < ids.shape[1]:
        raise ValueError(f"num_actions={num_actions} must be between 1 and the row length - 1 ({ids.shape[1] - 1})")
    out: list[Trajectory | None] = []
    for b in range(ids.shape[0]):
        real = int(keep[b].sum())
        if keep[b, ids.shape[1] - real:].sum() != real:
            raise ValueError(f"row {b}: its real tokens (attention_mask 1) are not one block at the end of the row; "
                             "SkyRL's batch is left-padded only ([pad.. prompt response])")
        scored = min(num_actions, real - 1)
        if scored < 1:
            out.append(None)
            continue
        tokens = ids[b, ids.shape[1] - real:].astype(np.int64)
        turn = Turn(prompt_ids=tokens[:real - scored], completion_ids=tokens[real - scored:],
                    advantages=np.zeros(scored), mask=np.ones(scored))
        out.append(Trajectory(group="batch", turns=(turn,), source="padded batch", index=b, unit="row"))
    return out


def window_token_logprobs(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, *,
                          entropy: bool = False, max_tokens: int | None = None, temperature: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, num_actions] log-probs (and entropies) of SkyRL's window (the module docstring), from one-pass rows:
    every row of the batch in prefix trees (a group's samples, and the turns of its step-wise trajectories, share
    their prompts), right-aligned back into the window, 0 where no real token follows a real one."""
    per_row = window_trajectories(sequences, attention_mask, num_actions)
    rows = [b for b, t in enumerate(per_row) if t is not None]
    scored = token_logprobs(model, layout_rollouts([per_row[b] for b in rows], max_tokens=max_tokens),
                            entropy=entropy, temperature=temperature) if rows else None

    def scatter(per_turn: Any) -> torch.Tensor:
        parts = [turns[0] for turns in per_turn] if per_turn is not None else []
        dtype = next((p.dtype for p in parts if len(p)), torch.float32)
        out = torch.zeros(len(per_row), num_actions, dtype=dtype, device=sequences.device)
        for b, part in zip(rows, parts):
            out[b, num_actions - len(part):] = part.to(out.device)  # a differentiable copy, right-aligned
        return out

    return (scatter(scored.logprobs if scored else None),
            scatter(scored.entropy if scored else None) if entropy else None)
