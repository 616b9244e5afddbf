"""Length buckets: a compiled kernel (flex_attention) meets a few row lengths, each padded forward as few tokens as can be."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.layout.buckets import bucket_of, length_buckets, length_buckets_reference, static_rows
from onepass.layout.tree import concat, row_from_columns


def padded(lengths, buckets, block):
    return sum(buckets[bisect.bisect_left(buckets, -(-n // block) * block)] for n in lengths)


def test_the_worked_example():
    assert length_buckets([300, 500, 520, 900, 1000], most=2) == (640, 1024)
    assert length_buckets([300, 500, 520, 900, 1000], most=1) == (1024,)
    assert length_buckets([1000] * 7, most=4) == (1024,)  # one length: one bucket, however many allowed


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=25), most=st.integers(1, 5),
       block=st.sampled_from([1, 64, 128]))
def test_buckets_are_few_whole_tiles_hold_every_forward_and_pad_least(lengths, most, block):
    buckets = length_buckets(lengths, most=most, block=block)
    assert 1 <= len(buckets) <= most and list(buckets) == sorted(set(buckets))
    assert all(b % block == 0 for b in buckets) and all(bucket_of(n, buckets) >= n for n in lengths)
    want = length_buckets_reference(lengths, most=most, block=block)
    assert padded(lengths, buckets, block) == padded(lengths, want, block)


def test_a_forward_past_the_last_bucket_is_refused():
    with pytest.raises(ValueError, match="longer than the longest length bucket"):
        bucket_of(1025, (512, 1024))


def _row(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 40, n)
    return row_from_columns({"input_ids": ids, "position_ids": np.arange(n), "kv_end": np.full(n, n),
                             "targets": np.append(ids[1:], -100), "weights": np.append(np.ones(n - 1), 0.0)})


def test_a_static_row_is_the_forward_s_rows_side_by_side_and_trains_the_same(one_thread):
    """The rows of a forward as one row padded to its bucket: the same float64 loss (documents never see each
    other; the pad sees only itself and trains nothing)."""
    from onepass.loss import batch_loss, layouts_to_batch
    from onepass.model.tiny import tiny_model

    rows = [_row(n, seed) for seed, n in enumerate((9, 14, 5))]
    (row,), length = static_rows(rows, (16, 32))
    assert length == 32 and len(row) == 28
    assert np.array_equal(row.kv_end, concat(rows).kv_end)
    model = tiny_model("qwen3", 40, dtype=torch.float64, attn_implementation="sdpa")
    want = batch_loss(model, layouts_to_batch(rows))
    got = batch_loss(model, layouts_to_batch([row], length=length))
    assert float((got - want).abs()) <= 1e-12 * float(want)
