"""One-pass RL scoring equals per-turn forwards (float64): every log-prob, entropy, loss and gradient.

The rollouts are not written for the tests: :func:`onepass.rl.synthetic.template_rollouts` renders
seeded multi-turn groups with the real Qwen3 chat template (which drops earlier reasoning, so turn
k+1 is not an extension of turn k), seed 2811 (used nowhere else in the suite). The reference is
a plain HF forward per turn (:func:`onepass.rl.logprobs.turn_logprobs_reference`).
"""

from __future__ import annotations

import json

import pytest
import torch

import onepass.rl.losses as losses
from onepass.cli import main
from onepass.model.precision import float64_norms
from onepass.rl.layout import layout_rollouts
from onepass.rl.logprobs import token_logprobs, token_logprobs_reference
from onepass.rl.losses import PolicyLossConfig, policy_loss, policy_loss_reference
from onepass.rl.rollouts import to_record, trajectories_from_records
from onepass.rl.synthetic import template_rollouts
from onepass.rl.verify import compact_rollouts, run_rl_verify
from onepass.attention.backends import cpu_backend
from onepass.model.tiny import tiny_config, tiny_model
from onepass.verify.check import max_rel_grad_diff, parameter_grads

TOL = 1e-9
SEED = 2811
DENSE, WINDOWED, HYBRID = ["qwen3"], ["mistral-window", "gpt-oss"], ["qwen3.5"]


@pytest.fixture(scope="module")
def rollouts(qwen3_tokenizer):
    records = template_rollouts(qwen3_tokenizer, num_groups=3, group_size=3, seed=SEED)
    return compact_rollouts(trajectories_from_records(records, source=f"template rollouts seed {SEED}"))


def exact_model(arch, vocab):
    backend = cpu_backend(tiny_config(arch, vocab), None)  # what onepass picks on CPU: onepass_cpu
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=backend)
    float64_norms(model)
    return model


def max_abs(a, b):
    return max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys) if len(x))


@pytest.mark.parametrize("max_tokens", [None, 160])
@pytest.mark.parametrize("arch", DENSE + WINDOWED + HYBRID)
def test_token_logprobs_and_entropy_equal_per_turn_forwards(rollouts, one_thread, arch, max_tokens):
    trajs, vocab = rollouts
    model = exact_model(arch, vocab)
    batch = layout_rollouts(trajs, max_tokens=max_tokens)
    assert batch.one_pass_tokens < batch.per_turn_tokens
    if max_tokens is not None:
        assert len(batch.rows) > 1 and all(len(r) <= max_tokens for r in batch.rows)
    with torch.no_grad():
        got = token_logprobs(model, batch, entropy=True)
        want = token_logprobs_reference(model, trajs, entropy=True)
    for xs, t in zip(got.logprobs, trajs):
        assert [len(x) for x in xs] == [len(turn.completion_ids) for turn in t.turns]
    assert max_abs(got.logprobs, want.logprobs) <= TOL
    assert max_abs(got.entropy, want.entropy) <= TOL


def sampler_logprobs(trajs):
    return [[turn.logprobs for turn in t.turns] for t in trajs]


CONFIGS = {
    "grpo-sequence": PolicyLossConfig(normalize="sequence"),
    "dapo-token-clip-higher": PolicyLossConfig(clip_high=0.28, normalize="token"),
    "dr-grpo-constant": PolicyLossConfig(normalize="constant", constant=1000.0),
    "trajectory-kl-tis": PolicyLossConfig(normalize="trajectory", kl_coef=0.1, tis_cap=1.5),
    "distill": PolicyLossConfig(clip_high=0.28, distill_coef=1.0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_policy_loss_and_every_gradient_equal_per_turn(rollouts, one_thread, name):
    trajs, vocab = rollouts
    model = exact_model("qwen3", vocab)
    config = CONFIGS[name]
    old = sampler_logprobs(trajs)  # not the policy's: ratios far from 1, so clipping is exercised
    with torch.no_grad():
        teacher = token_logprobs_reference(exact_model("llama", vocab), trajs).logprobs
    kw = dict(old=old, ref=old, teacher=teacher)
    batch = layout_rollouts(trajs, max_tokens=200)
    model.zero_grad()
    want = policy_loss_reference(model, trajs, config, backward=True, **kw)
    want_grads = parameter_grads(model)
    model.zero_grad()
    got = policy_loss(model, batch, config, backward=True, **kw)
    got_grads = parameter_grads(model)
    assert 0 < want.clip_fraction < 1 and got.clip_fraction == want.clip_fraction
    assert abs(got.loss.item() - want.loss.item()) <= TOL * abs(want.loss.item())
    assert max_rel_grad_diff(want_grads, got_grads)[0] <= TOL
    assert max(g.norm().item() for g in got_grads.values()) > 0


def test_the_graph_path_equals_the_row_by_row_backward(rollouts, one_thread):
    trajs, vocab = rollouts
    model = exact_model("qwen3", vocab)
    batch = layout_rollouts(trajs, max_tokens=200)
    config = PolicyLossConfig(kl_coef=0.05)
    ref = sampler_logprobs(trajs)
    model.zero_grad()
    policy_loss(model, batch, config, ref=ref).loss.backward()
    whole = parameter_grads(model)
    model.zero_grad()
    policy_loss(model, batch, config, ref=ref, backward=True)
    assert max_rel_grad_diff(whole, parameter_grads(model))[0] <= TOL


def test_a_missing_input_is_one_line():
    trajs = trajectories_from_records([{"group": "g", "turns": [{"prompt_ids": [1], "completion_ids": [2],
                                                                 "advantage": 1.0}]}])
    with pytest.raises(losses.ConfigError, match="record 0, turn 0 has none"):
        losses._check_inputs(trajs, PolicyLossConfig(tis_cap=2.0), None, None)
    with pytest.raises(losses.ConfigError, match="kl_coef > 0 needs ref"):
        losses._check_inputs(trajs, PolicyLossConfig(kl_coef=0.1), None, None)


def test_the_clipped_surrogate_by_hand():
    lp = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    old = torch.log(torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64))  # ratios 2, 0.5, 1
    term, clipped = losses.token_loss(lp, advantages=torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64),
                                      old=old, config=PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    # ratio 2, A 1: min(2, 1.28) = 1.28; ratio 0.5, A -1: min(-0.5, -0.8) = -0.8; ratio 1: 1
    assert torch.allclose(term, torch.tensor([-1.28, 0.8, -1.0], dtype=torch.float64))
    assert clipped.tolist() == [True, True, False]


@pytest.mark.parametrize("arch", DENSE + WINDOWED + HYBRID)
def test_onepass_verify_rollouts_with_a_model_directory_says_equal(rollouts, tmp_path, capsys, monkeypatch, arch):
    monkeypatch.setenv("ONEPASS_DEBUG", "1")  # an older release's refusal raises (conftest.promised_refusal)
    trajs, vocab = rollouts
    tiny_model(arch, vocab, dtype=torch.float64, attn_implementation="eager").save_pretrained(tmp_path / "model")
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(to_record(t)) + "\n" for t in trajs))
    code = main(["verify", "--rollouts", str(path), "--model", str(tmp_path / "model"), "--dtype", "float64",
                 "--limit", "5"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last["equal"], last
    assert last["max_abs_logprob_diff"] <= TOL and last["max_rel_grad_diff"] <= TOL and last["token_ratio"] > 1


def test_onepass_verify_rollouts_exits_1_when_a_logprob_differs(rollouts, tmp_path, capsys, monkeypatch):
    trajs, vocab = rollouts
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(to_record(t)) + "\n" for t in trajs[:3]))
    real = losses.row_logprobs

    def off_by_a_little(*args, **kw):
        for i, k, lp, ent in real(*args, **kw):
            yield i, k, lp + 1e-6, ent

    monkeypatch.setattr(losses, "row_logprobs", off_by_a_little)
    assert main(["verify", "--rollouts", str(path), "--tiny", "qwen3"]) == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not last["equal"] and last["max_abs_logprob_diff"] > 1e-7
    assert "differing_layer" in last  # where it differs is looked for (here: no layer, the scoring itself)


def test_run_rl_verify_counts_tokens(rollouts):
    trajs, vocab = rollouts
    report = run_rl_verify(trajs[:3], exact_model("qwen3", vocab))
    batch = layout_rollouts(trajs[:3])
    assert report.equal and report.per_turn_tokens == batch.per_turn_tokens
    assert report.token_ratio == batch.per_turn_tokens / batch.one_pass_tokens
