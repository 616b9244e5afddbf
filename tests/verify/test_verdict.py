"""One rule for "exact" (:func:`onepass.verify.divergence.judge`) in the guard, ``onepass verify`` and
``onepass verify --rollouts``: outputs within the tolerance, a gradient past it only by rounding.

Why: a gated-delta-net decay's gradient (``A_log``, ``dt_bias``) sums thousands of terms of both signs,
so its relative difference between one-pass and N-pass is cancellation, not structure. Measured with a
tiny float64 Qwen3.5 on 10 bundled conversations: loss 0, every layer's output within 3.4e-16, ``dt_bias``
1.05e-9 (run_verify). The guard accepted that; ``verify``'s strict rule called it DIFFERENT. Here the gradient
difference is raised by a fixed amount on an exact model (what cancellation does), so the verdict is
tested deterministically: rounding below :data:`ROUNDING` is EQUAL with ``rounding: true``, above it or
in an output it is DIFFERENT.
"""

from __future__ import annotations

import json

import pytest

import onepass.rl.verify as rl_verify
import onepass.verify.check as verify
from onepass.cli import main
from onepass.verify.divergence import ROUNDING, TOLERANCE, LayerDiff, judge
from onepass.rl.rollouts import to_record, trajectories_from_records
from onepass.rl.synthetic import template_rollouts
from onepass.rl.verify import compact_rollouts

GOOD = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                     {"role": "user", "content": "and 3+3?"},
                     {"role": "assistant", "content": "6", "reasoning_content": "add again"}]}


def _raised(module, by):
    real = module.max_rel_grad_diff

    def raised(reference, other):
        rel, name = real(reference, other)
        return rel + by, name

    return raised


def _verify(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    code = main(["verify", "--data", str(data), "--tiny", "qwen3"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out, json.loads(out[-1])


def test_verify_calls_a_gradient_rounded_past_the_tolerance_equal(tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setattr(verify, "max_rel_grad_diff", _raised(verify, 5 * TOLERANCE))
    code, out, last = _verify(tmp_path, capsys)
    assert code == 0 and last["equal"] and last["rounding"], out
    assert last["max_rel_grad_diff"] > TOLERANCE and last["max_layer_diff"] <= TOLERANCE
    assert "EQUAL (a gradient rounds differently; every output agrees)" in out[-3]
    assert out[-2].startswith("every layer's output agrees within") and out[-2].endswith("(rounding only)")


def test_verify_says_different_past_rounding(tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setattr(verify, "max_rel_grad_diff", _raised(verify, 10 * ROUNDING))
    code, out, last = _verify(tmp_path, capsys)
    assert code == 1 and not last["equal"] and not last["rounding"] and "-> DIFFERENT" in out[-3]


def test_verify_without_differences_locates_nothing(tmp_path, capsys, one_thread):
    code, out, last = _verify(tmp_path, capsys)
    assert code == 0 and last["equal"] and "rounding" not in last and out[-2].endswith("-> EQUAL within 1e-09")


def test_an_output_difference_never_rounds_away():
    agree = LayerDiff(index=None, layer_type=None, mixer=None, max_diff=1e-15)
    assert not judge(2 * TOLERANCE, 0.0, where=lambda: agree).equal  # a loss / log-prob differs
    assert not judge(0.0, float("nan"), where=lambda: agree).equal
    differs = LayerDiff(index=1, layer_type="conv", mixer="Lfm2ShortConv", max_diff=1e-4)
    assert not judge(0.0, 2 * TOLERANCE, where=lambda: differs).equal  # a layer's output differs
    unknown = LayerDiff(index=None, layer_type=None, mixer=None, max_diff=None)  # outputs not compared
    assert not judge(0.0, 2 * TOLERANCE, where=lambda: unknown).equal


@pytest.mark.parametrize("by,code", [(5 * TOLERANCE, 0), (10 * ROUNDING, 1)])
def test_verify_rollouts_judges_gradients_the_same_way(tmp_path, capsys, monkeypatch, qwen3_tokenizer, one_thread,
                                                       by, code):
    trajs, _ = compact_rollouts(trajectories_from_records(template_rollouts(qwen3_tokenizer, num_groups=2,
                                                                            group_size=2, seed=5)))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(to_record(t)) + "\n" for t in trajs))
    monkeypatch.setattr(rl_verify, "max_rel_grad_diff", _raised(rl_verify, by))
    got = main(["verify", "--rollouts", str(path), "--tiny", "qwen3"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == code and last["equal"] == (code == 0) and last["rounding"] == (code == 0)
