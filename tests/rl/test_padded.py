"""The padded-batch adapters (TRL's [B, P + C] layout, SkyRL's left-padded blocks) give the per-row log-probs,
entropies and gradients (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onepass.model.precision import float64_norms
from onepass.rl.logprobs import turn_logprobs_reference
from onepass.rl.padded import padded_token_logprobs, padded_trajectories, window_token_logprobs, window_trajectories
from onepass.rl.rollouts import Trajectory, Turn, trajectories_from_records
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


# --------------------------------------------------------------------------------------------
# SkyRL's layout: one left-padded block per row, the response right-aligned in the last W positions


def window_batch(trajs, pad=0):
    """Every turn as a row of SkyRL's layout: [pad.. prompt completion], W = the longest completion."""
    turns = [t for traj in trajs for t in traj.turns]
    s = max(t.num_tokens for t in turns)
    w = max(len(t.completion_ids) for t in turns)
    ids, mask = np.full((len(turns), s), pad), np.zeros((len(turns), s), dtype=int)
    for b, t in enumerate(turns):
        ids[b, s - t.num_tokens:] = np.concatenate([t.prompt_ids, t.completion_ids])
        mask[b, s - t.num_tokens:] = 1
    return torch.as_tensor(ids), torch.as_tensor(mask), w, turns


def test_window_log_probs_entropies_and_gradients_equal_each_rows_own_forward(qwen3_tokenizer, one_thread):
    """Every real token of the window with a real token before it (a short response's window reaches into its
    prompt, a short row's into its padding: 0 there), at temperature 0.7, equals the row's own forward."""
    records = template_rollouts(qwen3_tokenizer, num_groups=2, group_size=2, seed=2813)
    trajs, vocab = compact_rollouts(trajectories_from_records(records))
    one = np.ones(2)
    tiny = Trajectory(group="short", turns=(Turn(prompt_ids=np.array([5, 6]), completion_ids=np.array([7, 8]),
                                                  advantages=one, mask=one),))
    sequences, attention_mask, w, turns = window_batch(list(trajs) + [tiny])
    short = len(turns) - 1
    assert turns[short].num_tokens <= w  # its window starts in its padding
    model = tiny_model("qwen3", vocab, dtype=torch.float64)
    float64_norms(model)
    weights = torch.randn(len(turns), w, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    model.zero_grad()
    got, ent = window_token_logprobs(model, sequences, attention_mask, w, entropy=True, max_tokens=300,
                                     temperature=0.7)
    ((got * weights).sum() + ent.sum()).backward()
    got_grads = parameter_grads(model)

    model.zero_grad()
    want, want_ent = torch.zeros(len(turns), w, dtype=torch.float64), torch.zeros(len(turns), w, dtype=torch.float64)
    total = 0.0
    for b, t in enumerate(turns):
        row = np.concatenate([t.prompt_ids, t.completion_ids])
        scored = min(w, len(row) - 1)
        whole = Trajectory(group="g", turns=(Turn(prompt_ids=row[:len(row) - scored], completion_ids=row[-scored:],
                                                   advantages=np.zeros(scored), mask=np.ones(scored)),))
        lp, e = turn_logprobs_reference(model, whole, 0, entropy=True, temperature=0.7)
        total = total + (lp * weights[b, w - scored:]).sum() + e.sum()
        want[b, w - scored:], want_ent[b, w - scored:] = lp.detach(), e.detach()
    total.backward()
    assert (got.detach() - want).abs().max().item() <= TOL
    assert (ent.detach() - want_ent).abs().max().item() <= TOL
    assert max_rel_grad_diff(parameter_grads(model), got_grads)[0] <= TOL
    assert (got[short, :w - turns[short].num_tokens + 1] == 0).all()  # padding and the row's first token


def test_a_window_batch_that_is_not_left_padded_is_one_line():
    with pytest.raises(ValueError, match="row 1: its real tokens .* not one block at the end"):
        window_trajectories(torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), 2)
    assert window_trajectories(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 0, 0, 1]]), 2) == [None]
