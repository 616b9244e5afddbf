"""A group's turns in one prefix tree: every turn's slot holds its completion; budgets split and pack."""

from __future__ import annotations

import numpy as np
import pytest

from onepass.errors import DataError
from onepass.rl.layout import layout_rollouts
from onepass.rl.rollouts import trajectories_from_records
from onepass.layout.tree import ancestors_reference

H, A, B, C = 10, 11, 12, 13


def one_turn(group, prompt, completion):
    return {"group": group, "turns": [{"prompt_ids": prompt, "completion_ids": completion, "advantage": 1.0}]}


def test_the_docstring_example_by_hand():
    trajs = trajectories_from_records([one_turn("g", [H], [A, B]), one_turn("g", [H], [A, C])])
    batch = layout_rollouts(trajs)
    (row,) = batch.rows
    assert row.input_ids.tolist() == [H, A, B, A, C]
    assert row.position_ids.tolist() == [0, 1, 2, 1, 2]
    assert row.kv_end.tolist() == [5, 3, 3, 5, 5]
    assert row.targets.tolist() == [A, B, -100, C, -100]
    assert batch.slots[0][0].positions.tolist() == [0, 1] and batch.slots[1][0].positions.tolist() == [0, 3]
    assert batch.per_turn_tokens == 6 and batch.one_pass_tokens == 5


def multi_turn_records(seed=7, groups=3, size=3, vocab=20):
    rng = np.random.default_rng(seed)
    records = []
    for g in range(groups):
        task = rng.integers(0, vocab, 5).tolist()
        for _ in range(size):
            history, turns = list(task), []
            for _ in range(int(rng.integers(1, 4))):
                completion = rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
                turns.append({"prompt_ids": list(history), "completion_ids": completion, "advantage": 1.0})
                history += completion[-1:] + rng.integers(0, vocab, 2).tolist()  # reasoning dropped
            records.append({"group": f"g{g}", "turns": turns})
    return trajectories_from_records(records)


@pytest.mark.parametrize("max_tokens", [None, 30, 60])
def test_every_slot_sees_exactly_its_turn(max_tokens):
    trajs = multi_turn_records()
    batch = layout_rollouts(trajs, max_tokens=max_tokens)
    for i, traj in enumerate(trajs):
        for k, t in enumerate(traj.turns):
            slot = batch.slots[i][k]
            row = batch.rows[slot.row]
            assert row.targets[slot.positions].tolist() == t.completion_ids.tolist()
            view = np.concatenate([t.prompt_ids, t.completion_ids])
            for j, q in enumerate(slot.positions):  # what q sees, in order, is the view before its target
                seen = ancestors_reference(row, int(q))
                assert row.input_ids[seen].tolist() == view[:len(t.prompt_ids) + j].tolist()
                assert row.position_ids[seen].tolist() == list(range(len(seen)))
    if max_tokens is not None:
        assert all(len(r) <= max_tokens for r in batch.rows)


def test_a_group_is_one_tree_sharing_its_prompt_and_groups_do_not_mix():
    trajs = multi_turn_records()
    batch = layout_rollouts(trajs)
    assert batch.num_trees == 3 and len(batch.rows) == 3
    for r in range(3):
        groups = {trajs[i].group for i, _ in batch.turns_in_row(r)}
        assert len(groups) == 1
    assert batch.one_pass_tokens < batch.per_turn_tokens
    per_turn = layout_rollouts(trajs, per_turn=True)
    assert per_turn.one_pass_tokens == per_turn.per_turn_tokens == batch.per_turn_tokens


def test_a_budget_packs_trees_best_fit():
    trajs = multi_turn_records()
    alone = layout_rollouts(trajs)
    packed = layout_rollouts(trajs, max_tokens=sum(len(r) for r in alone.rows))
    assert len(packed.rows) == 1 and packed.one_pass_tokens == alone.one_pass_tokens


def test_a_turn_longer_than_the_budget_is_an_error_naming_it():
    trajs = trajectories_from_records([one_turn("g", [H] * 3, [A]), one_turn("g", [H] * 9, [A, B])])
    with pytest.raises(DataError, match=r"record 1, turn 0: a turn of 11 tokens is longer than max_tokens=8"):
        layout_rollouts(trajs, max_tokens=8)
