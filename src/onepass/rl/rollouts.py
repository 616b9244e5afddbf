"""Token-in/token-out RL rollouts: one trajectory per record, validated before any model runs.

Why this module exists: RL must score the exact tokens the sampler produced, never a
re-tokenised text, and a multi-turn rollout whose template drops earlier reasoning is
not one growing sequence (turn k+1's prompt need not extend turn k's prompt +
completion). So a trajectory is a list of turns, each the prompt the model saw and
the completion it sampled, as token ids::

    {"group": "q17",                                   # trajectories of one group share a prompt
     "turns": [{"prompt_ids": [..], "completion_ids": [..],
                "advantage": 0.5,                      # or "advantages": one per completion token
                "logprobs": [..],                      # optional: the sampler's, one per completion token
                "mask": [1, 1, 0, ..]},                # optional: 0 = not trained (e.g. tool output)
               ...]}

Every error names the file, the record (line for .jsonl) and the turn, in one line;
nothing is dropped or changed silently (a bad record stops the read).

No torch here: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onepass.errors import DataError
from onepass.conversation.records import iter_records

TURN_KEYS = frozenset({"prompt_ids", "completion_ids", "advantage", "advantages", "logprobs", "mask"})


class RolloutError(DataError):
    """A rollout record that cannot be used; the message names file, record and turn."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One turn: what the model saw and what it sampled. Per-token arrays have len(completion_ids)."""

    prompt_ids: np.ndarray  # int64 [P], P >= 1
    completion_ids: np.ndarray  # int64 [C]
    advantages: np.ndarray  # float64 [C]
    logprobs: np.ndarray | None = None  # float64 [C]: the sampler's log-probs
    mask: np.ndarray  # float64 [C]: 1 = trained, 0 = scored only

    @property
    def num_tokens(self) -> int:  # the per-turn forward's length
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trajectory:
    group: str
    turns: tuple[Turn, ...]
    source: str = "<memory>"
    index: int = 0  # record number (line number for .jsonl)
    unit: str = "record"

    def at(self, turn: int | None = None) -> str:
        """Where this trajectory (or one of its turns) came from: ``FILE line 3, turn 1``."""
        where = f"{self.source} {self.unit} {self.index}"
        return where if turn is None else f"{where}, turn {turn}"


def _ids(value: Any, what: str, where: str, *, nonempty: bool) -> np.ndarray:
    if not isinstance(value, (list, tuple)):
        raise RolloutError(f"{where}: {what} must be a list of token ids, got {type(value).__name__}")
    if nonempty and not value:
        raise RolloutError(f"{where}: {what} is empty (a completion token needs a prompt token to predict it from)")
    for j, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= x < 2**63:
            raise RolloutError(f"{where}: {what}[{j}] = {x!r:.40} is not a token id (an int from 0 to 2^63 - 1)")
    return np.asarray(value, dtype=np.int64).reshape(-1)


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range: 10**400
        return False


def _floats(value: Any, what: str, where: str, n: int) -> np.ndarray:
    if not isinstance(value, (list, tuple)):
        raise RolloutError(f"{where}: {what} must be a list of numbers, got {type(value).__name__}")
    if len(value) != n:
        raise RolloutError(f"{where}: {what} has {len(value)} values for {n} completion tokens")
    for j, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not _finite(x):
            raise RolloutError(f"{where}: {what}[{j}] = {x!r:.40} is not a finite number")
    return np.asarray(value, dtype=np.float64).reshape(-1)


def parse_turn(raw: Any, where: str) -> Turn:
    """One turn record as a :class:`Turn`; ``where`` names it in errors."""
    if not isinstance(raw, Mapping):
        raise RolloutError(f"{where}: a turn must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TURN_KEYS)
    if unknown:
        raise RolloutError(f"{where}: unknown turn field(s) {', '.join(map(repr, unknown))}; "
                           f"a turn has {', '.join(sorted(TURN_KEYS))}")
    for key in ("prompt_ids", "completion_ids"):
        if key not in raw:
            raise RolloutError(f"{where}: missing {key!r}")
    prompt = _ids(raw["prompt_ids"], "prompt_ids", where, nonempty=True)
    completion = _ids(raw["completion_ids"], "completion_ids", where, nonempty=False)
    n = len(completion)
    if ("advantage" in raw) == ("advantages" in raw):
        raise RolloutError(f"{where}: give exactly one of 'advantage' (a number for the turn) "
                           f"and 'advantages' (one per completion token)")
    if "advantage" in raw:
        advantages = np.full(n, _floats([raw["advantage"]], "advantage", where, 1)[0])
    else:
        advantages = _floats(raw["advantages"], "advantages", where, n)
    logprobs = None if raw.get("logprobs") is None else _floats(raw["logprobs"], "logprobs", where, n)
    if logprobs is not None and (logprobs > 0).any():
        j = int(np.argmax(logprobs > 0))
        raise RolloutError(f"{where}: logprobs[{j}] = {float(logprobs[j])!r} is positive (a log-probability is <= 0)")
    mask = np.ones(n)
    if raw.get("mask") is not None:
        mask = _floats(raw["mask"], "mask", where, n)
        if not np.isin(mask, (0.0, 1.0)).all():
            j = int(np.argmax(~np.isin(mask, (0.0, 1.0))))
            raise RolloutError(f"{where}: mask[{j}] = {float(mask[j])!r}; a mask holds 0 (not trained) or 1 (trained)")
    return Turn(prompt_ids=prompt, completion_ids=completion, advantages=advantages, logprobs=logprobs, mask=mask)


def parse_trajectory(record: Any, *, source: str = "<memory>", index: int = 0, unit: str = "record") -> Trajectory:
    """One record as a :class:`Trajectory`; errors name ``source``, the record and the turn."""
    where = f"{source} {unit} {index}"
    if isinstance(record, Exception):  # a line the reader could not decode
        raise RolloutError(str(record))
    if not isinstance(record, Mapping):
        raise RolloutError(f"{where}: a trajectory must be an object with 'group' and 'turns', "
                           f"got {type(record).__name__}")
    group = record.get("group")
    if not isinstance(group, str):
        raise RolloutError(f"{where}: 'group' must be a string (trajectories of one group share a prompt), "
                           f"got {group!r}")
    turns = record.get("turns")
    if not isinstance(turns, (list, tuple)) or not turns:
        raise RolloutError(f"{where}: 'turns' must be a non-empty list of turns")
    parsed = tuple(parse_turn(t, f"{where}, turn {k}") for k, t in enumerate(turns))
    return Trajectory(group=group, turns=parsed, source=source, index=index, unit=unit)


def trajectories_from_records(records: Iterable[Any], *, source: str = "<memory>") -> list[Trajectory]:
    """Python records (dicts as in the module docstring) as trajectories; record i is numbered i."""
    return [parse_trajectory(r, source=source, index=i) for i, r in enumerate(records)]


def read_rollouts(path: str | Path) -> list[Trajectory]:
    """Every trajectory of a .jsonl / .json / .parquet file; the first bad record stops the read."""
    path = Path(path)
    unit = "line" if path.suffix.lower() in (".jsonl", ".ndjson") else "record"
    out = [parse_trajectory(record, source=str(path), index=i, unit=unit) for i, record in iter_records(path)]
    if not out:
        raise RolloutError(f"{path}: no trajectories")
    return out


def to_record(trajectory: Trajectory) -> dict[str, Any]:
    """A trajectory as a JSON-ready record (per-token advantages; the inverse of :func:`parse_trajectory`)."""
    turns = []
    for t in trajectory.turns:
        turn: dict[str, Any] = {"prompt_ids": t.prompt_ids.tolist(), "completion_ids": t.completion_ids.tolist(),
                                "advantages": t.advantages.tolist(), "mask": t.mask.astype(int).tolist()}
        if t.logprobs is not None:
            turn["logprobs"] = t.logprobs.tolist()
        turns.append(turn)
    return {"group": trajectory.group, "turns": turns}


def check_vocab(trajectories: Sequence[Trajectory], vocab_size: int) -> None:
    """Every token id < ``vocab_size``, else one line naming the first turn that has one."""
    for traj in trajectories:
        for k, t in enumerate(traj.turns):
            for what, ids in (("prompt_ids", t.prompt_ids), ("completion_ids", t.completion_ids)):
                if len(ids) and ids.max() >= vocab_size:
                    raise RolloutError(f"{traj.at(k)}: {what} holds token id {int(ids.max())}, "
                                       f"outside the model's vocabulary of {vocab_size}")
