"""The collectives of sequence parallelism, differentiable, over real ranks or simulated ones.

Why this module exists: Ulysses needs one collective, an all-to-all (rank r sends piece j of its
tensor to rank j); an all-gather is an all-to-all that sends the same tensor to everyone. Its
gradient is the transposed all-to-all (what rank r sent to j comes back from j), so one autograd
function serves the forward heads/sequence exchange, its inverse, and the sequence all-gather
of the recurrent mixers (the gradient of a gathered tensor is the sum of what every rank sends
back for its shard: autograd adds the S copies).

Two groups implement it:

- :class:`TorchGroup`: a ``torch.distributed`` process group (the ``sp`` dimension of the run's
  device mesh; gloo on CPU, nccl on CUDA);
- :class:`ThreadGroup`: S ranks simulated by S threads of one process, exchanging tensors through
  a barrier: the slow reference the layout is tested against in one process, and what the
  sequence-parallel guard (:mod:`onepass.guard.sequence_parallel`) runs a tiny twin on.

:class:`SequenceShard` is what a forward pass carries to every attention layer and recurrent mixer:
the group, this rank, and the three exchanges the model needs.

Legend: B batch, H query heads, J key/value heads, L row length, S degree, D head size, E hidden.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from onepass.parallel.plan import HeadSplit


class TorchGroup:
    """All-to-all over a ``torch.distributed`` process group."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_to_all(self, sends: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """``sends[j]`` goes to rank j; returns what each rank sent here (same shapes: the shards are equal).

        One ``all_to_all_single`` over the stacked pieces (equal splits along the first dimension), not the
        list ``all_to_all``: gloo has the single-tensor collective in every torch onepass allows, the list
        one only from torch 2.13 (2.11's gloo: "Backend gloo does not support alltoall")."""
        import torch.distributed as dist

        assert rank == self.rank and len(sends) == self.size
        send_S = torch.stack(list(sends))  # piece j in row j: rank j's share
        recv_S = torch.empty_like(send_S)
        dist.all_to_all_single(recv_S, send_S, group=self.group)
        return list(recv_S.unbind(0))


class ThreadGroup:
    """S ranks simulated by S threads of this process (:func:`run_ranks`); tensors pass through shared slots."""

    def __init__(self, size: int, *, timeout: float = 120.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Sequence[torch.Tensor] | None] = [None] * size

    def all_to_all(self, sends: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        assert len(sends) == self.size
        self._slots[rank] = sends
        self._barrier.wait()  # every rank has posted
        recvs = [self._slots[j][rank].clone() for j in range(self.size)]  # type: ignore[index]
        self._barrier.wait()  # every rank has read before any posts again
        return recvs

    def abort(self) -> None:
        self._barrier.abort()


def run_ranks(size: int, fn: Callable[[SequenceShard], Any], *, timeout: float = 120.0) -> list[Any]:
    """``fn(shard)`` on ``size`` simulated ranks (threads sharing one :class:`ThreadGroup`); their results.

    The model is shared: parameters are read concurrently, never written; a rank that raises breaks
    the barrier, so the others stop instead of waiting, and the first error is raised here.
    """
    group = ThreadGroup(size, timeout=timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def main(rank: int) -> None:
        try:
            results[rank] = fn(SequenceShard(group=group, rank=rank))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[rank] = e
            group.abort()

    threads = [threading.Thread(target=main, args=(r,), name=f"sp-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class _AllToAll(torch.autograd.Function):
    """``sends[j]`` to rank j; backward: the gradient of what came from j goes back to j."""

    @staticmethod
    def forward(ctx: Any, shard: SequenceShard, *sends: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shard = shard
        return tuple(shard.group.all_to_all(sends, shard.rank))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        shard = ctx.shard
        return (None, *shard.group.all_to_all([g.contiguous() for g in grads], shard.rank))


@dataclass(frozen=True, kw_only=True, eq=False)
class SequenceShard:
    """This rank's place in a sequence-parallel group, and the exchanges a forward pass makes.

    A model run with it (in its forward's record, :class:`onepass.parallel.forward.ForwardPlan`) holds positions
    :meth:`local` of every row; its attention layers call :meth:`to_heads` / :meth:`to_sequence`,
    its recurrent mixers :meth:`gather_sequence`.
    """

    group: Any  # TorchGroup | ThreadGroup: .size, .all_to_all(sends, rank)
    rank: int

    @property
    def degree(self) -> int:
        return int(self.group.size)

    def exchange(self, sends: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A differentiable all-to-all (``sends[j]`` to rank j)."""
        return list(_AllToAll.apply(self, *sends))

    def local(self, x_BL: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a whole-row tensor (dimension ``dim`` is the row, a multiple of the degree)."""
        return x_BL.chunk(self.degree, dim=dim)[self.rank]

    def to_heads(self, x_BHLD: torch.Tensor) -> torch.Tensor:
        """``[B, H, L/S, D]`` (all heads, this rank's positions) -> ``[B, H/S, L, D]`` (its heads, every position)."""
        return torch.cat(self.exchange(x_BHLD.chunk(self.degree, dim=1)), dim=2)

    def to_sequence(self, out_BLHD: torch.Tensor) -> torch.Tensor:
        """The inverse for an attention output: ``[B, L, H/S, D]`` -> ``[B, L/S, H, D]``."""
        return torch.cat(self.exchange(out_BLHD.chunk(self.degree, dim=1)), dim=2)

    def gather_sequence(self, x_BLE: torch.Tensor) -> torch.Tensor:
        """``[B, L/S, ...]`` -> ``[B, L, ...]``: every rank's positions (an all-gather; exact gradient)."""
        return torch.cat(self.exchange([x_BLE] * self.degree), dim=1)

    def gather_targets(self, values_T: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Every rank's per-target values in row order: ``counts[j]`` of them on rank j (every rank knows the
        whole row, so the counts); differentiable (a shard's gradient sums every rank's)."""
        most = max(counts)
        padded = torch.nn.functional.pad(values_T, (0, most - values_T.shape[0]))
        return torch.cat([got[:n] for got, n in zip(self.exchange([padded] * self.degree), counts)])

    def heads_of(self, split: HeadSplit, x_H: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-query-head tensor (attention sinks)."""
        start, stop = split.head_range(self.rank)
        return x_H[start:stop]


__all__ = ["SequenceShard", "ThreadGroup", "TorchGroup", "run_ranks"]
