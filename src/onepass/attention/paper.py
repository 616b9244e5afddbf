"""The seed paper's layout and role-id mask, kept as a visibly separate reference.

Why this module exists: onepass does not use the paper's layout (its tree layout
fixes two flaws of the published code, see docs/design.md), but the tests reproduce the
paper's mask on the paper's own token order to show where the two differ and
that they agree where they should. Nothing in the training path imports this.

The paper's mask (:func:`paper_layout`, :func:`paper_role_mask`) is kept as a
reference on the paper's own token order, ported from its published code
(https://github.com/devrev/One-Pass-to-Reason, ``one-pass-to-reason.patch``:
``ConversationalReasoningSupervisedDatasetProcessor._encode_data_example``,
``get_turn_ids``, ``prepare_conversational_reasoning_4d_attention_mask``).
From that code, not derived:

- roles: 0 pad, 1 human (the whole prompt segment of a turn), 2 reasoning,
  3 response-in (the *first*, untrained copy, used as history), 4 response-out
  (the *second*, trained copy, placed after the reasoning);
- order per turn: ``h t r_in r_out``; ``r_in`` is emitted for every turn,
  the last one included; a turn without reasoning is not duplicated: its
  response appears once, as role 3, with no labels (it is never trained);
- positions: h continues from the previous turn; t and r_in both start right
  after h; r_out starts after t; the next turn starts after r_in;
- turn ids: a counter that steps at every run of role-1 tokens;
- mask = causal & not-pad & (human_k | out_k & same_turn | in_k & q!=out |
  in_k & !same_turn | think_k & same_turn & q!=in).
  The boolean expression is the published one verbatim; the paper's own
  Karnaugh-map derivation was not available to check against. The expression
  relies on ``r_in`` preceding ``r_out``: causality, not the expression, keeps
  ``r_in`` from seeing its own turn's ``r_out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onepass.tree import IGNORE

ROLE_PAD, ROLE_HUMAN, ROLE_THINK, ROLE_RESPONSE_IN, ROLE_RESPONSE_OUT = 0, 1, 2, 3, 4

ArrayLike = np.ndarray | Sequence[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class PaperLayout:
    """One conversation in the paper's published format. All arrays have length L.

    labels are *unshifted*, as the published processor writes them: the trainer's
    standard shift makes position p predict ``labels[p + 1]``.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    role_ids: np.ndarray
    turn_ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def paper_layout(turns: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> PaperLayout:
    """The paper's sequence for ``turns`` = [(human, reasoning, response), ...] token lists.

    Per turn: ``h t r_in r_out`` (``r_out`` only when ``t`` is non-empty), every ``r_in`` kept.
    """
    ids: list[int] = []
    pos: list[int] = []
    roles: list[int] = []
    turn_ids: list[int] = []
    labels: list[int] = []
    cur = 0
    for i, (h, t, r) in enumerate(turns, start=1):
        h, t, r = list(h), list(t), list(r)
        if not h or not r:
            raise ValueError(f"turn {i}: the human and response segments must be non-empty "
                             f"(got {len(h)} and {len(r)} tokens); turn ids are counted from human runs")
        ids += h + t + r
        roles += [ROLE_HUMAN] * len(h) + [ROLE_THINK] * len(t) + [ROLE_RESPONSE_IN] * len(r)
        pos += range(cur, cur + len(h))
        cur += len(h)
        pos += list(range(cur, cur + len(t))) + list(range(cur, cur + len(r)))
        labels += [IGNORE] * len(h) + t + [IGNORE] * len(r)
        if t:  # published code: `duplicate = len(reasoning_ids) != 0`
            ids += r
            roles += [ROLE_RESPONSE_OUT] * len(r)
            pos += range(cur + len(t), cur + len(t) + len(r))
            labels += r
        cur += len(r)
        turn_ids += [i] * (len(ids) - len(turn_ids))
    ids_, pos_, roles_, turns_, labels_ = (np.asarray(x, dtype=np.int64)
                                           for x in (ids, pos, roles, turn_ids, labels))
    return PaperLayout(input_ids=ids_, position_ids=pos_, role_ids=roles_, turn_ids=turns_,
                       labels=labels_)


def paper_turn_ids(role_ids: ArrayLike) -> np.ndarray:
    """The published ``get_turn_ids``: a counter that steps at the first token of each human run."""
    role = np.asarray(role_ids)
    prev = np.zeros_like(role)
    prev[..., 1:] = role[..., :-1]
    step = (role == ROLE_HUMAN) & (prev != ROLE_HUMAN)
    return np.where(role != ROLE_PAD, np.cumsum(step, axis=-1), 0)


def paper_role_mask(role_ids: ArrayLike, turn_ids: ArrayLike | None = None) -> np.ndarray:
    """The published role-id mask, bool ``[.., Q, K]`` (True = may attend). Valid on the paper's order only."""
    role = np.asarray(role_ids)
    turn = paper_turn_ids(role) if turn_ids is None else np.asarray(turn_ids)
    idx = np.arange(role.shape[-1])
    causal = idx[:, None] >= idx[None, :]
    not_pad = role != ROLE_PAD
    same_turn = turn[..., :, None] == turn[..., None, :]
    role_q, role_k = role[..., :, None], role[..., None, :]
    human_k, think_k = role_k == ROLE_HUMAN, role_k == ROLE_THINK
    in_k, out_k = role_k == ROLE_RESPONSE_IN, role_k == ROLE_RESPONSE_OUT
    q_not_in, q_not_out = role_q != ROLE_RESPONSE_IN, role_q != ROLE_RESPONSE_OUT
    allowed = (human_k | (out_k & same_turn) | (in_k & q_not_out) | (in_k & ~same_turn)
               | (think_k & same_turn & q_not_in))
    return causal & not_pad[..., :, None] & not_pad[..., None, :] & allowed
