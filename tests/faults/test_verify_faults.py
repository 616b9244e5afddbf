"""``onepass verify`` never gives a vacuous verdict, and verifies the data that will be trained (issue 37, round 3).

Before: every record skipped, or ``--limit 0``, said EQUAL (exit 0) having checked nothing; ``verify --rollouts``
said EQUAL when the gradients were not finite (the relative difference skipped NaN) and DIFFERENT (exit 1) on
an exact one-token case where a gradient is zero up to rounding; a 10-record file said "8 conversations" and
nothing of the limit; a turn the template raises for (gpt-oss on agent data) stopped ``verify`` with exit 2,
where ``prepare`` skips it and trains the rest. The one rule is :func:`onepass.verify.divergence.judge` (with its
gradient measure :func:`~onepass.verify.divergence.max_rel_grad_diff`), so the guard says the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from onepass.cli import main

GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
GPTOSS = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "gptoss.jinja"


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(capsys, *argv):
    code = main(["verify", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_record_skipped_is_an_error_not_equal(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "bot", "content": "x"}]}\nnot json\n')
    code, out, err = _run(capsys, "--data", str(data))
    assert code == 2 and "EQUAL" not in out, out
    assert err.strip().splitlines()[-1].startswith(f"onepass: error: verify checked nothing: no view of {data} could "
                                                   "be rendered (0 conversations read); first: ")


def _usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["verify", *argv])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "EQUAL" not in captured.out
    return captured.err.strip().splitlines()[-1]


def test_limit_0_is_an_error_not_equal(tmp_path, capsys):
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD])
    assert _usage_error(capsys, "--data", str(data), "--limit", "0") == (
        "onepass verify: error: argument --limit: must be at least 1 (a number of conversations), got 0")


@pytest.mark.parametrize("tolerance", ["inf", "1", "-1", "nan", "0"])
def test_a_tolerance_that_accepts_anything_or_nothing_is_an_error(tmp_path, capsys, tolerance):
    # --tolerance inf said "EQUAL within inf" whatever the difference; -1 said DIFFERENT and blamed layer 0
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD])
    code, out, err = _run(capsys, "--data", str(data), "--tolerance", tolerance)
    assert code == 2 and "EQUAL" not in out and "DIFFERENT" not in out
    assert err.strip().startswith("onepass: error: --tolerance must be a relative difference above 0 and below 1")


def test_verify_says_its_default_limit_cut_the_data(tmp_path, capsys, one_thread):
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 10)
    code, out, _ = _run(capsys, "--data", str(data))
    assert code == 0
    assert out.splitlines()[0] == ("verifying 8 conversations: 8 read, the first 8 valid (--limit 8, verify's "
                                   "default; there are more)")
    last = json.loads(out.strip().splitlines()[-1])
    assert (last["conversations_read"], last["limit"], last["limited"]) == (8, 8, True)
    code, out, _ = _run(capsys, "--data", str(data), "--limit", "10")
    assert out.splitlines()[0] == "verifying 10 conversations: 10 read, every valid one"


def test_verify_skips_the_turns_prepare_skips_and_checks_the_rest(tmp_path, capsys, one_thread):
    # gpt-oss raises for a tool-call turn holding both content and reasoning (tau-bench with reasoning):
    # prepare skips that view and trains the final answer; verify stopped with exit 2 at the first raise
    call = {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
            "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]}
    agent = {"messages": [{"role": "user", "content": "find x"}, call,
                          {"role": "tool", "content": "x=1"},
                          {"role": "assistant", "content": "x is 1", "reasoning_content": "read it"},
                          {"role": "user", "content": "and y?"},
                          {"role": "assistant", "content": "y is 2", "reasoning_content": "y"}]}
    data = _jsonl(tmp_path / "agent.jsonl", [agent, GOOD])
    argv = ["--data", str(data), "--chat-template", str(GPTOSS)]
    assert main(["prepare", *argv, "--no-progress", "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    capsys.readouterr()
    code, out, _ = _run(capsys, *argv)
    assert code == 0, out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["equal"] and last["num_views"] == stats["views_trained"] == 2
    assert last["views_skipped"] == stats["views_skipped"] == 2
    assert last["views_skipped_by_reason"] == stats["skipped_by_reason"] == {"template error": 2}
    assert "2 views skipped as prepare skips them (template error: 2); first: " in out.splitlines()[0]
    code, out, err = _run(capsys, *argv, "--strict")
    assert code == 2 and "line 1, message 1: the chat template raised" in err


def _rollouts(tmp_path, records):
    return _jsonl(tmp_path / "rollouts.jsonl", records)


def test_a_gradient_zero_up_to_rounding_is_equal_on_an_exact_one_token_case(tmp_path, capsys, one_thread):
    # a one-token prompt: attention over one key does not depend on the query, so q_proj's gradient is 0,
    # computed as ~1e-16 on each side; relative to itself that was a 200% difference (DIFFERENT, exit 1)
    path = _rollouts(tmp_path, [{"group": "g", "turns": [{"prompt_ids": [1], "completion_ids": [4],
                                                          "advantage": 1.0}]}])
    code, out, _ = _run(capsys, "--rollouts", str(path))
    last = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and last["equal"] and last["max_rel_grad_diff"] < 1e-12, out


def test_gradients_that_are_not_finite_are_different(tmp_path, capsys, one_thread):
    records = [{"group": "g", "turns": [{"prompt_ids": [1, 2, 3], "completion_ids": [4 + 2 * i, 5 + 2 * i],
                                         "advantage": a}]} for i, a in enumerate((1e308, -1e308))]
    code, out, _ = _run(capsys, "--rollouts", str(_rollouts(tmp_path, records)))
    last = json.loads(out.replace("NaN", "null").strip().splitlines()[-1])
    assert code == 1 and not last["equal"] and last["finite"] is False, out
    assert "-> DIFFERENT (a difference is not finite" in out


def test_verify_rollouts_with_limit_0_is_an_error(tmp_path, capsys):
    path = _rollouts(tmp_path, [{"group": "g", "turns": [{"prompt_ids": [1], "completion_ids": [4], "advantage": 1}]}])
    assert "argument --limit: must be at least 1" in _usage_error(capsys, "--rollouts", str(path), "--limit", "0")


def test_rollouts_without_a_completion_token_are_an_error(tmp_path, capsys):
    path = _rollouts(tmp_path, [{"group": "g", "turns": [{"prompt_ids": [1], "completion_ids": [], "advantage": 1}]}])
    code, out, err = _run(capsys, "--rollouts", str(path))
    assert code == 2 and "EQUAL" not in out and "verify --rollouts checked nothing" in err


def test_the_gradient_measure_never_skips_nan():
    from onepass.verify.divergence import judge, max_rel_grad_diff

    ref = {"a": torch.ones(3), "b": torch.ones(3)}
    for bad in (math.nan, math.inf):
        other = {"a": torch.ones(3) * 2, "b": torch.tensor([1.0, bad, 1.0])}  # the NaN after a finite difference
        value, name = max_rel_grad_diff(ref, other)
        assert not math.isfinite(value) and name == "b"
        assert judge(0.0, value, where=lambda: 1 / 0).word.startswith("DIFFERENT (a difference is not finite")
    zero = {"a": torch.ones(3), "z": torch.full((3,), 1e-17)}
    assert max_rel_grad_diff(zero, {"a": torch.ones(3), "z": torch.full((3,), -1e-17)})[0] < 1e-15
    small = {"a": torch.ones(3), "s": torch.full((3,), 1e-3)}  # small but not zero: still relative
    assert max_rel_grad_diff(small, {"a": torch.ones(3), "s": torch.full((3,), 2e-3)}) == (pytest.approx(1.0), "s")


def test_gradients_that_are_all_zero_compare_as_equal_not_nan():
    from onepass.verify.divergence import max_rel_grad_diff

    zero = {"a": torch.zeros(3)}
    assert max_rel_grad_diff(zero, {"a": torch.zeros(3)}) == (0.0, "")
    assert max_rel_grad_diff(zero, {"a": torch.ones(3)})[0] == pytest.approx(3 ** 0.5)  # absolute, as before
