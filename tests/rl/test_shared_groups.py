"""RL groups whose prompts share a prefix (a system prompt) are scored in one tree per row (float64 exact).

:func:`onepass.rl.layout.layout_rollouts` under a row budget merges the trees of different groups that
share a prefix (:mod:`onepass.share`); every turn's slot still points at positions whose targets are its
completion, and the log-probs, the policy losses (each normalisation) and every gradient equal the
per-turn forwards. Seed 2812 (used nowhere else in the suite).
"""

from __future__ import annotations

import pytest
import torch

from onepass.data.synthetic import single_token_words, text_of_length
from onepass.attention.backends import cpu_backend
from onepass.precision import float64_norms
from onepass.rl.layout import layout_rollouts
from onepass.rl.logprobs import token_logprobs, token_logprobs_reference
from onepass.rl.losses import PolicyLossConfig, policy_loss, policy_loss_reference
from onepass.rl.rollouts import trajectories_from_records
from onepass.rl.synthetic import template_rollouts
from onepass.rl.verify import compact_rollouts
from onepass.tiny import tiny_config, tiny_model
from onepass.verify import max_rel_grad_diff, parameter_grads

TOL = 1e-9
SEED = 2812


@pytest.fixture(scope="module")
def rollouts(qwen3_tokenizer):
    import numpy as np

    system = text_of_length(80, np.random.default_rng(SEED), single_token_words(qwen3_tokenizer))
    records = template_rollouts(qwen3_tokenizer, num_groups=4, group_size=2, seed=SEED, system=system)
    return compact_rollouts(trajectories_from_records(records, source=f"template rollouts seed {SEED}"))


def exact_model(arch, vocab):
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=cpu_backend(tiny_config(arch, vocab), None))
    float64_norms(model)
    return model


def test_groups_sharing_a_system_prompt_share_rows(rollouts):
    trajs, _ = rollouts
    budget = 400
    shared = layout_rollouts(trajs, max_tokens=budget)
    apart = layout_rollouts(trajs, max_tokens=budget, share_prefix=False)
    assert shared.num_trees == apart.num_trees == 4
    assert shared.one_pass_tokens < apart.one_pass_tokens - 80  # the system prompt computed fewer times
    assert all(len(r) <= budget for r in shared.rows)
    rows_of_groups = {t.group: {s.row for s in slots} for t, slots in zip(trajs, shared.slots)}
    assert len({r for rows in rows_of_groups.values() for r in rows}) < len(rows_of_groups)  # groups share rows
    for t, slots in zip(trajs, shared.slots):
        for turn, slot in zip(t.turns, slots):
            assert shared.rows[slot.row].targets[slot.positions].tolist() == turn.completion_ids.tolist()


@pytest.mark.parametrize("arch", ["qwen3", "gpt-oss", "qwen3.5"])
def test_logprobs_of_shared_rows_equal_per_turn_forwards(rollouts, one_thread, arch):
    trajs, vocab = rollouts
    model = exact_model(arch, vocab)
    with torch.no_grad():
        got = token_logprobs(model, layout_rollouts(trajs, max_tokens=400), entropy=True)
        want = token_logprobs_reference(model, trajs, entropy=True)
    worst = max((x - y).abs().max().item() for xs, ys in zip(got.logprobs, want.logprobs) for x, y in zip(xs, ys)
                if len(x))
    assert worst <= TOL


@pytest.mark.parametrize("normalize", ["sequence", "token", "trajectory"])
def test_policy_loss_of_shared_rows_equals_per_turn(rollouts, one_thread, normalize):
    trajs, vocab = rollouts
    model = exact_model("qwen3", vocab)
    old = [[turn.logprobs for turn in t.turns] for t in trajs]
    config = PolicyLossConfig(normalize=normalize, kl_coef=0.05)
    model.zero_grad()
    want = policy_loss_reference(model, trajs, config, backward=True, old=old, ref=old)
    want_grads = parameter_grads(model)
    model.zero_grad()
    got = policy_loss(model, layout_rollouts(trajs, max_tokens=400), config, backward=True, old=old, ref=old)
    assert abs(got.loss.item() - want.loss.item()) <= TOL * abs(want.loss.item())
    assert max_rel_grad_diff(want_grads, parameter_grads(model))[0] <= TOL
