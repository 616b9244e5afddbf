"""The padded-batch adapter (TRL's [B, P + C] layout) gives the per-row log-probs and gradients (float64)."""

from __future__ import annotations

import numpy as np
import torch

from onepass.model.precision import float64_norms
from onepass.rl.logprobs import turn_logprobs_reference
from onepass.rl.padded import padded_token_logprobs, padded_trajectories
from onepass.rl.rollouts import trajectories_from_records
from onepass.rl.synthetic import template_rollouts
from onepass.rl.verify import compact_rollouts
from onepass.model.tiny import tiny_model
from onepass.verify.check import max_rel_grad_diff, parameter_grads

TOL = 1e-9


def padded_batch(trajs, pad=0):
    """Every turn as a row: prompts left-padded, completions right-padded (as TRL's GRPOTrainer holds them)."""
    turns = [t for traj in trajs for t in traj.turns]
    p = max(len(t.prompt_ids) for t in turns)
    c = max(len(t.completion_ids) for t in turns)
    ids = np.full((len(turns), p + c), pad)
    mask = np.zeros((len(turns), p + c), dtype=int)
    for b, t in enumerate(turns):
        ids[b, p - len(t.prompt_ids):p] = t.prompt_ids
        ids[b, p:p + len(t.completion_ids)] = t.completion_ids
        mask[b, p - len(t.prompt_ids):p + len(t.completion_ids)] = 1
    return torch.as_tensor(ids), torch.as_tensor(mask), c, turns


def test_padded_log_probs_and_gradients_equal_per_row_forwards(qwen3_tokenizer, one_thread):
    records = template_rollouts(qwen3_tokenizer, num_groups=2, group_size=3, seed=2812)
    trajs, vocab = compact_rollouts(trajectories_from_records(records))
    input_ids, attention_mask, c, turns = padded_batch(trajs)
    back = padded_trajectories(input_ids, attention_mask, c)
    assert [t.turns[0].prompt_ids.tolist() for t in back] == [t.prompt_ids.tolist() for t in turns]
    assert [t.turns[0].completion_ids.tolist() for t in back] == [t.completion_ids.tolist() for t in turns]

    model = tiny_model("qwen3", vocab, dtype=torch.float64)
    float64_norms(model)
    weights = torch.randn(len(turns), c, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    got, ent = padded_token_logprobs(model, input_ids, attention_mask, c, entropy=True, max_tokens=400)
    ((got * weights).sum() + ent.sum()).backward()
    got_grads = parameter_grads(model)

    model.zero_grad()
    want = torch.zeros(len(turns), c, dtype=torch.float64)
    total = 0.0
    for b, traj in enumerate(padded_trajectories(input_ids, attention_mask, c)):
        lp, e = turn_logprobs_reference(model, traj, 0, entropy=True)
        n = len(lp)
        total = total + (lp * weights[b, :n]).sum() + e.sum()
        want[b, :n] = lp.detach()
    total.backward()
    assert (got.detach() - want).abs().max().item() <= TOL
    assert max_rel_grad_diff(parameter_grads(model), got_grads)[0] <= TOL
    assert (got[attention_mask[:, -c:] == 0] == 0).all()
