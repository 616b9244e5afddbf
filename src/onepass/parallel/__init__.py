"""Sequence parallelism for one-pass rows: one row split over S ranks (Ulysses), exactly.

    plan.py       which positions and heads each rank holds, the padding, what each collective moves (numpy)
    comm.py       the all-to-all and its gradient over a process group or simulated thread ranks; the
                  SequenceShard a forward pass carries
    forward.py    the forward contract: one record (mask, chains, shard) per batch under one model keyword,
                  read by the attention wrapper and the recurrent mixers
    attention.py  each attention backend wrapped: all-to-all to heads, the backend on the whole row, back
    model.py      a model made sequence-parallel: the static checks (heads), the wrapped backend

Is it exact for a model? The guard's check on a tiny float64 twin on simulated ranks:
:mod:`onepass.guard.sequence_parallel`.

Each rank holds a contiguous shard of every row for all layers but attention; attention runs the
model's own backend on every position for a subset of heads, so the ``kv_end`` rule, windows, sinks
and the chunked LM head run unchanged; recurrent mixers gather their input along the sequence and
scan the whole row chain by chain (:mod:`onepass.mixers.tree`). Position ids and ``kv_end`` stay
global. The loss of a rank is the weighted sum of its shard's targets; the normaliser stays the
step's global weight (:mod:`onepass.train.run.step`), so S ranks take the steps of one process.
docs/distributed.md says when to use it.
"""
