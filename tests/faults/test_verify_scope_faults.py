"""``onepass verify`` checks what ``prepare`` trains, and never calls nothing EQUAL (issue 44, items 7 and 10).

Before the fix (b757769): ``verify --rollouts`` on trajectories whose every completion token has mask 0
said EQUAL (exit 0) on all-zero gradients; ``verify --pack --max-tokens N`` stopped the whole run (exit 2,
"verify needs every view trained") when one view was over N, where ``prepare`` leaves that view out and
trains the rest.
"""

from __future__ import annotations

import json

import pytest

from onepass.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _turn(mask, advantage=1.0):
    return {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6], "advantage": advantage, "mask": mask}


def test_rollouts_whose_every_token_is_masked_are_an_error_not_equal(tmp_path, capsys):
    path = _jsonl(tmp_path / "rollouts.jsonl", [{"group": "g", "turns": [_turn([0, 0, 0]), _turn([0, 0, 0])]}])
    code, out, err = _run(capsys, "verify", "--rollouts", str(path))
    assert code == 2 and "EQUAL" not in out, (out, err)
    assert err.strip().splitlines()[-1] == (
        "onepass: error: verify --rollouts checked nothing: nothing is trained (every completion token of the 2 "
        "turns has mask 0: the per-turn loss has no gradient), so both sides' zero gradients agree on nothing (a "
        "verdict on nothing is no verdict)")


def test_a_trained_token_is_enough(tmp_path, capsys):
    # reference (passes on the old tree too): one unmasked token is a real check
    path = _jsonl(tmp_path / "rollouts.jsonl", [{"group": "g", "turns": [_turn([0, 0, 1])]}])
    code, out, err = _run(capsys, "verify", "--rollouts", str(path))
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["equal"], (out, err)


def _chat(i, words):
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": " ".join(f"w{k}" for k in range(words))},
                         {"role": "user", "content": "and?"}, {"role": "assistant", "content": "done"}]}


def test_verify_pack_with_a_budget_checks_what_prepare_trains_and_says_what_it_left_out(tmp_path, capsys):
    data = _jsonl(tmp_path / "chats.jsonl", [_chat(0, 3), _chat(1, 200), _chat(2, 4)])  # chat 1: its views are long
    budget = ["--max-tokens", "120", "--pack"]
    code, out, err = _run(capsys, "prepare", "--data", str(data), "--tokenizer", "builtin:qwen3", "--out",
                          str(tmp_path / "out"), "--no-progress", *budget)
    assert code == 0, (out, err)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["views_skipped"] == 2 and stats["views_trained"] == 4  # the long conversation: both views over
    code, out, err = _run(capsys, "verify", "--data", str(data), "--tokenizer", "builtin:qwen3", *budget)
    assert code == 0, (out, err)
    assert "2 views left out, as prepare leaves them out under --max-tokens 120; first: " in out, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["equal"] and report["views_left_out"] == 2
    assert (report["num_views"], report["n_pass_tokens"]) == (stats["views_trained"], stats["n_pass_tokens"])


def test_verify_with_every_view_over_the_budget_checked_nothing(tmp_path, capsys):
    data = _jsonl(tmp_path / "chats.jsonl", [_chat(1, 200)])
    code, out, err = _run(capsys, "verify", "--data", str(data), "--tokenizer", "builtin:qwen3", "--max-tokens", "120",
                          "--pack")
    assert code == 2 and "EQUAL" not in out, (out, err)
    assert "verify checked nothing: prepare would train none of the 2 views under max_tokens=120; first: " in err
