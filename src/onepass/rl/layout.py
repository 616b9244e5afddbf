"""All turns of all trajectories of a group in one prefix tree, packed into rows.

Why this module exists: a GRPO group is G trajectories of T turns, each turn a
separate forward today (the template drops earlier reasoning, so turn k+1 is not
an extension of turn k). Every turn is a view (``prompt_ids`` context,
``completion_ids`` scored), so the SFT layout applies unchanged: the views of a
group go into one :class:`onepass.tree.PrefixTree` (the group's shared prompt
stored once, each trajectory's history shared by its turns), the tree is laid
out depth-first, and trees are packed into rows (:mod:`onepass.pack`). Two
trajectories that sampled the same first tokens share those nodes too: a node
holds one target, and equal ancestors + equal target = equal log-prob.

What the RL side needs beyond the SFT layout is the way back: for every turn,
the row and the row positions whose targets are its completion tokens
(:class:`TurnSlot`). Example, a group of two one-turn trajectories with prompt
``h`` and completions ``a b`` and ``a c``::

    p  token  pos  kv_end  target       slot of traj 0: positions [0, 1] (targets a, b)
    0  h      0    5       a            slot of traj 1: positions [0, 3] (targets a, c)
    1  a      1    3       b            the node 'h -> a' is shared: one log-prob, two users
    2  b      2    3       -
    3  a      1    5       c            (a second 'a': its target c differs from b)
    4  c      2    5       -

No torch here: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onepass.errors import DataError
from onepass.pack import best_fit_decreasing
from onepass.rl.rollouts import Trajectory
from onepass.schedule import Schedule, schedule_views
from onepass.share import share_and_pack
from onepass.tree import Layout, PrefixTree, concat
from onepass.view import View


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnSlot:
    """Where one turn's completion tokens are scored: ``rows[row].targets[positions] == completion_ids``."""

    row: int
    positions: np.ndarray  # int64 [C]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutBatch:
    """Trajectories, the rows that score them, and per trajectory and turn its :class:`TurnSlot`."""

    trajectories: tuple[Trajectory, ...]
    rows: tuple[Layout, ...]
    slots: tuple[tuple[TurnSlot, ...], ...]  # [trajectory][turn]
    num_trees: int

    @property
    def one_pass_tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def per_turn_tokens(self) -> int:
        """Tokens the per-turn forwards run (the token bound one-pass is compared to)."""
        return sum(t.num_tokens for traj in self.trajectories for t in traj.turns)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for traj in self.trajectories for t in traj.turns)

    def turns_in_row(self, row: int) -> list[tuple[int, int]]:
        """(trajectory, turn) of every turn scored in ``row``."""
        return [(i, k) for i, slots in enumerate(self.slots) for k, s in enumerate(slots) if s.row == row]


def turn_view(trajectory: Trajectory, k: int) -> View:
    """Turn ``k`` as a view: ``prompt_ids + completion_ids``, the completion scored."""
    t = trajectory.turns[k]
    return View(tokens=np.concatenate([t.prompt_ids, t.completion_ids]), num_prompt=len(t.prompt_ids), turn=k,
                source=trajectory.at())


def _groups(trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """Trajectory indices by group, groups in order of first appearance."""
    by: dict[str, list[int]] = {}
    for i, traj in enumerate(trajectories):
        by.setdefault(traj.group, []).append(i)
    return list(by.values())


def layout_rollouts(trajectories: Sequence[Trajectory], *, max_tokens: int | None = None,
                    per_turn: bool = False, share_prefix: bool = True) -> RolloutBatch:
    """The rows scoring ``trajectories``: one tree per group, split and packed under ``max_tokens``.

    ``max_tokens``: a group whose tree is larger is split into trees that fit, turns kept
    whole and in order (the ``budget`` schedule of :mod:`onepass.schedule`), and trees are
    packed best-fit into rows of at most ``max_tokens``; unset, one row per group. A turn
    longer than ``max_tokens`` on its own is an error (RL drops no tokens). ``per_turn``:
    one tree and one row per turn (the baseline the benchmark compares to). ``share_prefix``
    (with ``max_tokens``): trees of different groups whose prompts share a prefix (a system prompt
    and tools) are merged into one tree per row (:mod:`onepass.share`); the trees of one group are
    not merged with each other (they were split to fit).
    """
    trajectories = tuple(trajectories)
    trees: list[tuple[Layout, list[tuple[int, int, np.ndarray]]]] = []  # layout, (traj, turn, tree positions)
    group_of: list[int] = []  # the group of each tree
    for g, members in enumerate(_groups(trajectories)):
        keys = [(i, k) for i in members for k in range(len(trajectories[i].turns))]
        views = [turn_view(trajectories[i], k) for i, k in keys]
        if per_turn:
            groups = [[j] for j in range(len(views))]
        else:
            scheduled = schedule_views(views, Schedule(kind="budget"), max_tokens=max_tokens)
            if scheduled.skipped:
                i, k = keys[int(np.argmax([len(v) for v in views]))]
                raise DataError(f"{trajectories[i].at(k)}: a turn of {trajectories[i].turns[k].num_tokens} "
                                f"tokens is longer than max_tokens={max_tokens}; raise max_tokens")
            groups = scheduled.groups
        for group in groups:
            trees.append(_tree([views[j] for j in group], [keys[j] for j in group]))
            group_of.append(g)

    slots: list[list[TurnSlot | None]] = [[None] * len(t.turns) for t in trajectories]
    if share_prefix and max_tokens is not None and not per_turn:
        shared = share_and_pack([layout for layout, _ in trees], group_of, max_tokens)
        for (_, turns), (r, where) in zip(trees, shared.where):
            for i, k, positions in turns:
                slots[i][k] = TurnSlot(row=r, positions=where[positions])
                assert np.array_equal(shared.rows[r].targets[where[positions]], trajectories[i].turns[k].completion_ids)
        return RolloutBatch(trajectories=trajectories, rows=tuple(shared.rows),
                            slots=tuple(tuple(s) for s in slots), num_trees=len(trees))  # type: ignore[arg-type]
    lengths = [len(layout) for layout, _ in trees]
    if max_tokens is None or per_turn:
        bins = [[j] for j in range(len(trees))]
    else:
        bins = best_fit_decreasing(lengths, max_tokens)
    rows = []
    for r, members in enumerate(bins):
        offset = 0
        for j in members:
            for i, k, positions in trees[j][1]:
                slots[i][k] = TurnSlot(row=r, positions=positions + offset)
            offset += lengths[j]
        rows.append(concat([trees[j][0] for j in members]))
    assert all(s is not None for turn_slots in slots for s in turn_slots)
    return RolloutBatch(trajectories=trajectories, rows=tuple(rows),
                        slots=tuple(tuple(s) for s in slots), num_trees=len(trees))  # type: ignore[arg-type]


def _tree(views: Sequence[View], keys: Sequence[tuple[int, int]]
          ) -> tuple[Layout, list[tuple[int, int, np.ndarray]]]:
    """One tree of ``views`` and, per view, the tree positions that score its completion."""
    tree = PrefixTree()
    paths = [np.asarray(tree.insert_path(v), dtype=np.int64) for v in views]
    layout = tree.layout()
    rank = np.empty(len(tree), dtype=np.int64)
    rank[tree.dfs_order()] = np.arange(len(tree))
    out = []
    for (i, k), view, path in zip(keys, views, paths):
        positions = rank[path[view.num_prompt - 1:len(view) - 1]]  # node p predicts token p + 1
        assert np.array_equal(layout.targets[positions], view.tokens[view.num_prompt:])
        out.append((i, k, positions))
    return layout, out

