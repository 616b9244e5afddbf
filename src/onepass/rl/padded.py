"""Per-token log-probs for a padded [B, P + C] batch (TRL's GRPO layout), computed from one-pass rows.

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

What is not covered: multimodal inputs, MoE auxiliary losses and sampling
temperature != 1 (the caller keeps its own path for those).
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
                          *, entropy: bool = False, max_tokens: int | None = None
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
    scored = token_logprobs(model, layout_rollouts(trajectories, max_tokens=max_tokens), entropy=entropy)

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
