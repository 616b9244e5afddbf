"""Rollout records: what is accepted, and one line naming file, record and turn for what is not."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.rl.rollouts import (
    RolloutError,
    check_vocab,
    parse_trajectory,
    read_rollouts,
    to_record,
    trajectories_from_records,
)


def turn(**kw):
    return {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "advantage": 0.5, **kw}


def test_a_scalar_advantage_is_given_to_every_completion_token_and_mask_defaults_to_trained():
    (traj,) = trajectories_from_records([{"group": "g", "turns": [turn()]}])
    t = traj.turns[0]
    assert t.advantages.tolist() == [0.5, 0.5] and t.mask.tolist() == [1.0, 1.0] and t.logprobs is None
    assert t.num_tokens == 5 and traj.at(0) == "<memory> record 0, turn 0"


def test_per_token_fields_are_kept_as_given():
    raw = turn(advantage=None, logprobs=[-0.1, -2.0], mask=[1, 0])
    del raw["advantage"]
    raw["advantages"] = [1.0, -1.0]
    t = parse_trajectory({"group": "g", "turns": [raw]}).turns[0]
    assert t.advantages.tolist() == [1.0, -1.0] and t.logprobs.tolist() == [-0.1, -2.0] and t.mask.tolist() == [1, 0]


def test_a_record_written_by_to_record_reads_back_the_same(tmp_path):
    traj = parse_trajectory({"group": "g", "turns": [turn(logprobs=[-1.0, -0.5], mask=[0, 1]), turn()]})
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(to_record(traj)) + "\n")
    (back,) = read_rollouts(path)
    for a, b in zip(traj.turns, back.turns):
        for f in ("prompt_ids", "completion_ids", "advantages", "mask"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
    assert back.at(1) == f"{path} line 1, turn 1"


@pytest.mark.parametrize("bad, message", [
    ({"turns": [turn()]}, "'group' must be a string"),
    ({"group": "g", "turns": []}, "'turns' must be a non-empty list"),
    ({"group": "g", "turns": [turn(), turn(prompt_ids=[])]}, "turn 1: prompt_ids is empty"),
    ({"group": "g", "turns": [turn(completion_ids=[4, -1])]}, "turn 0: completion_ids[1] = -1 is not a token id"),
    ({"group": "g", "turns": [turn(completion_ids=[4, True])]}, "completion_ids[1] = True is not a token id"),
    ({"group": "g", "turns": [turn(advantages=[1.0, 2.0])]}, "give exactly one of 'advantage'"),
    ({"group": "g", "turns": [{"prompt_ids": [1], "completion_ids": [2]}]}, "give exactly one of 'advantage'"),
    ({"group": "g", "turns": [turn(advantage=float("nan"))]}, "advantage[0] = nan is not a finite number"),
    ({"group": "g", "turns": [turn(logprobs=[-1.0])]}, "logprobs has 1 values for 2 completion tokens"),
    ({"group": "g", "turns": [turn(logprobs=[-1.0, 0.5])]}, "logprobs[1] = 0.5 is positive"),
    ({"group": "g", "turns": [turn(mask=[1, 2])]}, "mask[1] = 2.0; a mask holds 0"),
    ({"group": "g", "turns": [turn(advantge=1.0)]}, "unknown turn field(s) 'advantge'"),
    ({"group": "g", "turns": [{"completion_ids": [2], "advantage": 1.0}]}, "missing 'prompt_ids'"),
    ([1, 2], "a trajectory must be an object"),
])
def test_a_bad_record_is_one_line_naming_file_line_and_turn(tmp_path, bad, message):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({"group": "ok", "turns": [turn()]}) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RolloutError) as e:
        read_rollouts(path)
    text = str(e.value)
    assert text.startswith(f"{path} line 2") and message in text and "\n" not in text


def test_a_line_that_is_not_json_names_its_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"group": "g", "turns": [turn()]}) + "\n{oops\n")
    with pytest.raises(RolloutError, match="line 2: not valid JSON"):
        read_rollouts(path)


def test_an_empty_file_has_no_trajectories(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n")
    with pytest.raises(RolloutError, match="no trajectories"):
        read_rollouts(path)


def test_a_token_outside_the_vocabulary_names_its_turn():
    trajs = trajectories_from_records([{"group": "g", "turns": [turn(), turn(completion_ids=[4, 99])]}])
    check_vocab(trajs, 100)
    with pytest.raises(RolloutError, match=r"record 0, turn 1: completion_ids holds token id 99, outside .* 99"):
        check_vocab(trajs, 99)
