"""RL inputs are one line naming the turn, never broadcast or passed through (issue 37, round 3, data side).

Before: ``policy_loss`` took a per-turn ``old`` / ``ref`` of the wrong length and broadcast it (a 1-value ``old``
applied to every token of the turn), and a NaN in it came out as a NaN loss; a token id >= 2^63 in a rollout
file was a raw ``OverflowError`` from numpy, an advantage of 10^400 (an int JSON reads) a raw ``OverflowError``.
"""

from __future__ import annotations

import math

import pytest
import torch

from onepass.rl.layout import layout_rollouts
from onepass.rl.losses import PolicyLossConfig, policy_loss, policy_loss_reference
from onepass.rl.rollouts import RolloutError, parse_trajectory, trajectories_from_records
from onepass.model.tiny import tiny_model

RECORDS = [{"group": "g", "turns": [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "advantage": 1.0},
                                    {"prompt_ids": [1, 2, 3, 4, 5, 6], "completion_ids": [7], "advantage": 1.0}]},
           {"group": "g", "turns": [{"prompt_ids": [1, 2], "completion_ids": [8, 9], "advantage": -1.0}]}]


@pytest.fixture(scope="module")
def setup():
    trajectories = trajectories_from_records(RECORDS, source="r.jsonl")
    model = tiny_model("qwen3", 16, dtype=torch.float64, attn_implementation="eager")
    return trajectories, layout_rollouts(trajectories), model


def _per_turn(trajectories, fill=-1.0):
    return [[torch.full((len(t.completion_ids),), fill, dtype=torch.float64) for t in traj.turns]
            for traj in trajectories]


@pytest.mark.parametrize("case,where", [
    ("one value for a turn of 3 tokens", "r.jsonl record 0, turn 0: old has shape (1,) for 3 completion tokens"),
    ("a turn missing", "r.jsonl record 1: old has 0 turns, the trajectory 1"),
    ("a NaN", "r.jsonl record 0, turn 1: old[0] = nan is not finite"),
    ("an inf in ref", "r.jsonl record 1, turn 0: ref[1] = -inf is not finite"),
])
def test_a_per_turn_input_of_the_wrong_shape_or_not_finite_is_one_line(setup, case, where):
    trajectories, batch, model = setup
    old, ref = _per_turn(trajectories), _per_turn(trajectories)
    if case == "one value for a turn of 3 tokens":
        old[0][0] = torch.tensor([-1.0], dtype=torch.float64)  # broadcast to the 3 tokens before
    elif case == "a turn missing":
        old[1] = []
    elif case == "a NaN":
        old[0][1][0] = math.nan
    else:
        ref[1][0][1] = -math.inf
    config = PolicyLossConfig(kl_coef=0.1)
    for loss in (lambda: policy_loss(model, batch, config, old=old, ref=ref),
                 lambda: policy_loss_reference(model, trajectories, config, old=old, ref=ref)):
        with pytest.raises(RolloutError) as e:
            loss()
        assert str(e.value).startswith(where), str(e.value)
    good = policy_loss(model, batch, config, old=_per_turn(trajectories), ref=_per_turn(trajectories)).loss
    assert torch.isfinite(good)


def test_a_turn_built_in_python_with_a_nan_advantage_is_one_line(setup):
    import dataclasses

    import numpy as np

    trajectories, _, model = setup
    turn = dataclasses.replace(trajectories[1].turns[0], advantages=np.array([1.0, np.nan]))
    bad = [trajectories[0], dataclasses.replace(trajectories[1], turns=(turn,))]
    with pytest.raises(RolloutError, match=r"r.jsonl record 1, turn 0: advantages must hold 2 finite values"):
        policy_loss(model, layout_rollouts(bad))


@pytest.mark.parametrize("turn,why", [
    ({"prompt_ids": [1, 2**63], "completion_ids": [2], "advantage": 1},
     "prompt_ids[1] = 9223372036854775808 is not a token id (an int from 0 to 2^63 - 1)"),
    ({"prompt_ids": [1], "completion_ids": [2**64], "advantage": 1},
     "completion_ids[0] = 18446744073709551616 is not a token id"),
    ({"prompt_ids": [1], "completion_ids": [2], "advantage": 10**400},
     "advantage[0] = 1000000000000000000000000000000000000000 is not a finite number"),
    ({"prompt_ids": [1], "completion_ids": [2], "advantages": [-10**400]}, "advantages[0] = -10000"),
])
def test_numbers_past_what_a_rollout_can_hold_are_one_line(turn, why):
    with pytest.raises(RolloutError) as e:
        parse_trajectory({"group": "g", "turns": [turn]}, source="r.jsonl", index=3, unit="line")
    assert str(e.value).startswith(f"r.jsonl line 3, turn 0: {why}"), str(e.value)
    assert parse_trajectory({"group": "g", "turns": [{"prompt_ids": [2**63 - 1], "completion_ids": [1],
                                                      "advantage": 1e308}]}).turns[0].advantages[0] == 1e308


@pytest.mark.parametrize("field,value", [("kl_coef", math.nan), ("clip_high", math.inf), ("tis_cap", math.nan),
                                         ("distill_coef", -1.0), ("kl_coef", -0.1)])
def test_a_policy_loss_setting_that_is_not_finite_or_negative_is_one_line(field, value):
    # before: kl_coef=nan was accepted (NaN is truthy) and every loss came out NaN
    from onepass.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        PolicyLossConfig(**{field: value})
