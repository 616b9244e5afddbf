"""The all-to-all of sequence parallelism over real gloo ranks, on every torch onepass allows.

tests/parallel/test_layout.py runs the exchanges over simulated ranks (threads); this is the one
collective over a real ``torch.distributed`` group: 2 CPU processes, float64, what each rank receives
and the gradient that comes back, held against the pieces by hand. On torch 2.11 (the floor, make
test-min) gloo has no list ``all_to_all``: the exchange must go through ``all_to_all_single``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onepass.parallel.comm import SequenceShard, TorchGroup

SIZE = 2


def piece(src: int, dst: int) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: a [2, 3] block whose values name both."""
    return torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * src + 100 * dst


def weight(src: int, dst: int) -> float:
    return 1.0 + src + 10.0 * dst


def rank_main(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE)
    try:
        shard = SequenceShard(group=TorchGroup(dist.group.WORLD), rank=rank)
        sends = [piece(rank, j).requires_grad_() for j in range(SIZE)]
        recvs = shard.exchange(sends)
        for j, got in enumerate(recvs):
            assert torch.equal(got, piece(j, rank)), (rank, j, got)
        # rank r weighs what came from i by w(i, r), so the gradient of rank r's send to j is w(r, j): it
        # came back from j (w is not symmetric: a transposed return is caught)
        sum(weight(i, rank) * got.sum() for i, got in enumerate(recvs)).backward()
        for j, sent in enumerate(sends):
            assert torch.equal(sent.grad, torch.full_like(sent, weight(rank, j))), (rank, j, sent.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_pieces_reach_their_rank_and_gradients_come_back_over_gloo(tmp_path):
    mp.spawn(rank_main, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=SIZE, join=True)
