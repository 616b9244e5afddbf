"""A batch of rows on two sides: tensors on the device, and the same rows on the host for everything planned from them.

Why this module exists: a training step must never wait for the device. Everything the step derives
from the layout (the attention mask's tiles or segments, the recurrent mixers' chains, the target
positions the LM head reads, the row ends of a per-row loss) is host-side numpy work on ``kv_end``,
``position_ids`` and ``targets``. Read back from device tensors (``.cpu()``, ``.tolist()``,
``nonzero``, a boolean index), each of those is a blocking copy: the host stops until the GPU has
finished everything queued before it, then the GPU idles while the host plans. So the rows travel
twice, once: :func:`onepass.loss.layouts_to_batch` (the collator of both front ends) keeps the numpy
columns it stacked as a :class:`HostRows` under ``batch[HOST]``, and copies them to the device with
:func:`to_device` (pinned memory, ``non_blocking``: a copy queued behind the GPU's work, not awaited).

    >>> rows = HostRows.of(kv_end_BL=np.array([[3, 3, 3]]), position_ids_BL=np.array([[0, 1, 2]]),
    ...                    targets_BL=np.array([[5, -100, 7]]), weights_BL=np.array([[1.0, 0.0, 1.0]]),
    ...                    row_tokens_B=np.array([3]))
    >>> rows.keep_T.tolist()   # the trained positions, row-major in [B * L]: what the head gathers
    [0, 2]

A batch built elsewhere (a user's collator) has no host side: :func:`host_rows` reads its tensors
back once (one wait), so every path stays correct and only ours is free of waits.

Legend: B rows, L row length, T trained positions (targets), S sequence-parallel degree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.layout.tree import IGNORE

HOST = "host_rows"  # the batch key holding its HostRows (tensors under every other key)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostRows:
    """The rows of a ``[B, L]`` batch as numpy, padded as its tensors are.

    kv_end_BL, position_ids_BL, targets_BL  int64 [B, L]
    weights_BL                              float [B, L]
    row_tokens_B                            int64 [B]: each row's length before padding
    keep_T                                  int64 [T]: flat (row-major) positions of the targets, ``B * L`` based
    """

    kv_end_BL: np.ndarray
    position_ids_BL: np.ndarray
    targets_BL: np.ndarray
    weights_BL: np.ndarray
    row_tokens_B: np.ndarray
    keep_T: np.ndarray

    @classmethod
    def of(cls, *, kv_end_BL: np.ndarray, position_ids_BL: np.ndarray, targets_BL: np.ndarray,
           weights_BL: np.ndarray, row_tokens_B: np.ndarray) -> HostRows:
        return cls(kv_end_BL=kv_end_BL, position_ids_BL=position_ids_BL, targets_BL=targets_BL,
                   weights_BL=weights_BL, row_tokens_B=np.asarray(row_tokens_B, dtype=np.int64),
                   keep_T=np.flatnonzero(targets_BL.reshape(-1) != IGNORE))

    @property
    def shape(self) -> tuple[int, int]:
        return self.kv_end_BL.shape

    @property
    def row_ends(self) -> np.ndarray:
        """``[B]``: where each row's targets end in ``keep_T`` (targets are kept row-major)."""
        return np.cumsum((self.targets_BL != IGNORE).sum(axis=1))

    def padded(self, multiple: int) -> HostRows:
        """These rows padded to a multiple of ``multiple`` positions, as :func:`onepass.loss.pad_batch` pads
        the tensors (a pad sees only itself, trains nothing)."""
        B, L = self.shape
        pad = -L % multiple
        if not pad:
            return self
        tail = np.broadcast_to(np.arange(L + 1, L + pad + 1, dtype=self.kv_end_BL.dtype), (B, pad))
        return HostRows.of(kv_end_BL=np.concatenate([self.kv_end_BL, tail], axis=1),
                           position_ids_BL=np.pad(self.position_ids_BL, ((0, 0), (0, pad))),
                           targets_BL=np.pad(self.targets_BL, ((0, 0), (0, pad)), constant_values=IGNORE),
                           weights_BL=np.pad(self.weights_BL, ((0, 0), (0, pad))), row_tokens_B=self.row_tokens_B)

    def local(self, degree: int, rank: int) -> HostRows:
        """Rank ``rank``'s positions of rows split into ``degree`` equal shards (sequence parallelism:
        :meth:`onepass.parallel.comm.SequenceShard.local` on the host). Only the targets are local: the
        mask and the chains stay those of the whole rows."""
        B, L = self.shape
        assert L % degree == 0, f"rows of {L} positions do not split into {degree} shards"
        part = slice(rank * L // degree, (rank + 1) * L // degree)
        return HostRows.of(kv_end_BL=self.kv_end_BL, position_ids_BL=self.position_ids_BL[:, part],
                           targets_BL=self.targets_BL[:, part], weights_BL=self.weights_BL[:, part],
                           row_tokens_B=self.row_tokens_B)


def to_device(array: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` without waiting for it: on CUDA a pinned copy sent ``non_blocking``
    (the copy is queued behind the GPU's work; the pinned buffer is kept until it is done by torch's host
    allocator), elsewhere the array's own memory."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_rows(batch: Mapping[str, Any]) -> HostRows:
    """The batch's :class:`HostRows`: the one its collator kept, else (a batch built elsewhere, or one
    whose tensors no longer match it) its tensors read back, once."""
    kv_end_BL = batch["kv_end"]
    kept = batch.get(HOST)
    if isinstance(kept, HostRows) and kept.shape == tuple(kv_end_BL.shape):
        return kept
    read = {k: batch[k].detach().cpu().numpy() for k in ("kv_end", "position_ids", "targets", "weights")}
    B, L = read["kv_end"].shape
    tokens = batch["row_tokens"].detach().cpu().numpy() if "row_tokens" in batch else np.full(B, L)
    return HostRows.of(kv_end_BL=read["kv_end"], position_ids_BL=read["position_ids"],
                       targets_BL=read["targets"], weights_BL=read["weights"], row_tokens_B=tokens)


__all__ = ["HOST", "HostRows", "host_rows", "to_device"]
